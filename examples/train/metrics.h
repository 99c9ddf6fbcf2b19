#pragma once

// What the main job reports each step ([Note: the step's metrics]): one JSON line in the
// metrics file (rank 0), the scalars of that line in TensorBoard's event files (rank 0, or
// every rank), and a row of the printed table with the run's progress (rank 0, every
// --log-every steps).
#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <dtensor/comm_debug_mode.h>
#include <dtensor/device_stats.h>

#include "llama_flags.h"
#include "tensorboard/writer.h"

namespace dtensor::train {

// One step's figures, each rank's (the peak memory: already the largest rank's).
struct StepMetrics {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, step_s = 0, lr = 0, peak_resident_mib = 0;
  double max_live_tensor_mib = -1; // the largest rank's live CPU tensors at their peak (-1: not counted)
  std::map<CollectiveKind, int64_t> counts, bytes; // per kind: collectives, bytes sent
  std::map<std::string, std::map<CollectiveKind, int64_t>> by_group;
  nlohmann::json extra;     // the data's digest and position, the validation loss
  DeviceMemoryStats memory; // this rank's device during the step (a GPU's caching allocator)
};

// The TensorBoard tag of each scalar of a metrics line ([Note: TensorBoard's tags]):
// (tag, value) for every key of `line` that has one; the learning rate's tag names the
// optimizer.
std::vector<std::pair<std::string, double>> tensorboard_scalars(const nlohmann::json& line,
                                                                const std::string& optimizer);

// The folder of this run's event files: DIR/<date-time>[/rank_R], the date and time `stamp`
// (seconds since the epoch, the same on every rank).
std::string tensorboard_folder(const std::string& dir, int64_t stamp, bool all_ranks, int rank);

class StepLog {
 public:
  // Opens the metrics file (appended to when resuming from `start` > 0) and, with
  // --tensorboard, the event files in `tb_folder`; every rank calls it (a failure raises the
  // same error on every rank).
  // `val_batches`: the held-out batches a validation loss is computed over.
  StepLog(const Flags& f, int64_t start, int64_t flops_per_token, int64_t val_batches,
          const std::string& tb_folder);
  void print_header(bool device_memory) const;
  // Every rank calls it; rank 0 writes the line and prints the row.
  void log(const StepMetrics& m);

 private:
  nlohmann::json line(const StepMetrics& m) const;
  void print_row(const StepMetrics& m, const nlohmann::json& line) const;

  const Flags& f_;
  int64_t start_, flops_per_token_, val_batches_;
  int rank_, world_;
  std::ofstream metrics_;
  std::unique_ptr<TensorBoardWriter> tb_;
  std::chrono::steady_clock::time_point began_ = std::chrono::steady_clock::now();
};

} // namespace dtensor::train
