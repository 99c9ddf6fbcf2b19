#pragma once

// The recipe's files: its checkpoint folder, laid out as torchtitan's (--save DIR holds
// DIR/step-<N>, one complete dtensor checkpoint per saved step, the newest --keep-latest
// kept), and its metrics file. Nothing here replaces or deletes what the recipe did not
// write (docs/checkpoint.md, "The recipe's checkpoint folder").
#include <cstdint>
#include <fstream>
#include <string>

namespace dtensor::train {

struct Flags;

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
// else its newest complete step-<N> holding a training state (a model-only last save, or
// one in Hugging Face's format, is not resumed from); "" when there is none. Not collective.
std::string latest_checkpoint(const std::string& path);

// The weights to start from (--init-from): `path` itself when it is a complete checkpoint or
// a Hugging Face folder, else its newest complete step-<N> of any kind, else `path` (for
// load() to name what is wrong). Not collective.
std::string newest_saved(const std::string& path);

// Whether `dir` is a Hugging Face model folder (config.json and model.safetensors or its
// index), and whether it holds the recipe's training state (its "step"). Not collective.
bool is_hf_folder(const std::string& dir);
bool holds_train_state(const std::string& dir);

// [Note: where a run starts] As torchtitan's checkpointer: with --auto-resume the newest
// training state under --save, else --resume's, else --init-from's model weights (a Hugging
// Face folder read as --init-from-hf's; dropped with a warning when resuming, as torchtitan
// ignores initial_load_path once its folder holds a checkpoint), else --init-from-hf, else
// the seed's values. Sets f.resume / f.init_from / f.init_from_hf to what is read; a --resume
// of a model-only save is refused (usage), naming --init-from. Not collective: every rank
// reads the same file system before any group exists.
void resolve_start(Flags& f);

// Collective: opens `path` on rank 0 for the metrics (JSON lines), appending when `append`,
// else replacing it, but only when it is absent, empty or a metrics file (every line a JSON
// object with a "step"); every rank raises the same error otherwise, and nothing is written.
std::ofstream open_metrics(const std::string& path, bool append);

} // namespace dtensor::train
