#pragma once

// torchtitan's profiling.enable_profiling: every --profile-freq steps, one step traced by
// LibTorch's profiler (Kineto: the operators, autograd's backward, dtensor's collectives under
// their names, "dtensor::all_reduce" and so on, and every module called through the module
// seam as "module: layers.0.attention"), written as a Chrome trace per rank:
// DIR/iteration_<N>/rank<R>_trace.json, N the step counted from 1 (torchtitan's layout; open
// it in Perfetto or chrome://tracing). On a GPU, --memory-snapshot DIR records the CUDA caching
// allocator's events from the start and writes PyTorch's memory snapshot at the same steps:
// DIR/iteration_<N>/rank<R>_memory_snapshot.pickle (pytorch.org/memory_viz reads it).
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include <c10/core/Device.h>

#include <dtensor/module_hooks.h>

namespace dtensor::train {

class StepProfiler {
 public:
  // `folder` "": no traces; `memory_folder` "": no memory snapshots (a warning on the CPU).
  // `freq`: the steps N, 2N, ... (counted from 1) are traced. Modules are named by their path
  // in `root`.
  StepProfiler(std::string folder, std::string memory_folder, int64_t freq, int rank,
               c10::Device device, torch::nn::Module& root);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Around step `step` (counted from 0): begin starts the profiler when the step is traced,
  // end stops it and writes the trace (a failed write warns; training goes on).
  void begin(int64_t step);
  void end(int64_t step);

 private:
  bool profiled(int64_t step) const;
  // folder/iteration_<step + 1>/rank<R><name>, its folder made.
  std::filesystem::path path(const std::string& folder, int64_t step,
                             const std::string& name) const;

  std::string folder_, memory_folder_;
  int64_t freq_;
  int rank_;
  c10::Device device_;
  bool active_ = false;
  std::map<const torch::nn::Module*, std::string> names_;
  HookHandle scopes_; // the global hook that names modules while a trace records
};

} // namespace dtensor::train
