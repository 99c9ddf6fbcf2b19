#pragma once

// The recipe's files: its checkpoint folder, laid out as torchtitan's (--save DIR holds
// DIR/step-<N>, one complete dtensor checkpoint per saved step, the newest --keep-latest
// kept), and its metrics file. Nothing here replaces or deletes what the recipe did not
// write (docs/checkpoint.md, "The recipe's checkpoint folder").
#include <cstdint>
#include <fstream>
#include <string>

namespace dtensor::train {

class CheckpointFolder {
 public:
  CheckpointFolder() = default;
  // Collective: rank 0 checks that `root` is absent or a directory holding only what this
  // recipe writes (step-<N> checkpoints, the hidden files of a save in progress); every rank
  // raises the same error, naming the entries, otherwise. Nothing is written.
  CheckpointFolder(std::string root, int64_t keep_latest);

  std::string step_dir(int64_t step) const; // root/step-<N>
  // Rank 0: deletes the complete checkpoints beyond the newest `keep_latest` (0: none). A
  // failure is printed, not raised: the checkpoints are all still there.
  void prune() const;

 private:
  std::string root_;
  int64_t keep_latest_ = 0;
};

// The checkpoint to resume from: `path` itself when it is a complete dtensor checkpoint,
// else its newest complete step-<N>; "" when there is none. Not collective.
std::string latest_checkpoint(const std::string& path);

// Collective: opens `path` on rank 0 for the metrics (JSON lines), appending when `append`,
// else replacing it, but only when it is absent, empty or a metrics file (every line a JSON
// object with a "step"); every rank raises the same error otherwise, and nothing is written.
std::ofstream open_metrics(const std::string& path, bool append);

} // namespace dtensor::train
