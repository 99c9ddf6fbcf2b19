#pragma once

// Planning a job before running it: what one rank of a (simulated or real) world allocates,
// computes and sends in a training step, and whether every rank of every group issues the
// same collectives (docs/simulation.md). The simulated world itself is a process group
// setting ([Note: simulated worlds] in dtensor/process_group.h).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/comm_debug_mode.h>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace dtensor {

// Bytes of the simulated device's storage alive now and at peak since the last reset: in a
// simulated world, the rank's device memory (its tensors have shapes, no values, and every
// allocation is counted; [Note: the simulated device] in lib/sim/sim_device.cpp).
struct SimulatedMemoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
};
SimulatedMemoryStats simulated_memory_stats();
void reset_simulated_peak_memory();

// One phase of a training step as this rank ran it.
struct PhaseReport {
  std::string name;                          // "forward", "backward", "optimizer", ...
  std::vector<CollectiveRecord> collectives; // in the order issued
  int64_t flops = 0;      // of the matrix products and attention kernels ([Note: FLOPs])
  int64_t peak_bytes = 0; // simulated device bytes at the phase's peak (simulated worlds)
};

// One rank's step: memory by category, the fully_shard peak, phases.
struct RankReport {
  int rank = 0;
  int world_size = 1;
  bool simulated = false;
  int64_t parameter_bytes = 0; // this rank's pieces of the parameters
  int64_t gradient_bytes = 0;  // ... of their gradients (after the backward)
  int64_t optimizer_bytes = 0; // optimizer state tensors
  int64_t fsdp_peak_bytes = 0; // fully_shard's own peak (fsdp_memory_stats)
  int64_t start_bytes = 0;     // simulated device bytes alive when the step began
  int64_t peak_bytes = 0;      // simulated device bytes at the step's peak
  std::vector<PhaseReport> phases;

  // All phases' collectives, in order.
  std::vector<CollectiveRecord> collectives() const;
  int64_t flops() const;
  std::string to_json() const;
  static RankReport from_json(const std::string& json);
};

// Records one step on this rank: phase(name) starts a phase (ending the one before); finish
// ends the last and adds the memory of `params` and of `optimizer`'s state. Between its
// construction and finish, every collective, matrix product of the
// thread (and of the autograd threads it starts) and every allocation on the simulated
// device is attributed to the current phase.
class StepRecorder {
 public:
  StepRecorder();
  ~StepRecorder();
  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;

  void phase(const std::string& name);
  RankReport finish(const std::vector<at::Tensor>& params,
                    const torch::optim::Optimizer* optimizer);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// [Note: plan check] A place where the ranks of one group disagree: at `position` in the
// group's sequence of collectives, `ranks` issue different collectives (or none).
struct PlanMismatch {
  std::string group; // its label
  std::vector<int> members;
  int64_t position = 0;   // index in the group's sequence
  std::vector<int> ranks; // the ranks whose collective differs from the first member's
  std::string message;
};

// Every group seen in `reports` (each a rank's step), checked across its members that have a
// report: the same sequence of collectives (kind, reduce op, dtype, bytes) on all of them.
// Empty when the plan is consistent.
std::vector<PlanMismatch> check_plan(const std::vector<RankReport>& reports);

// The ranks a plan check of a world laid out as `mesh_shape` simulates: every rank when the
// world has at most 64; above, every coordinate's extremes (each mesh dimension at 0, 1 and
// its last index, the others at 0 or at their last) and `sample` more drawn with `seed`.
// Sorted, each once.
std::vector<int> ranks_to_simulate(const std::vector<int64_t>& mesh_shape, int64_t sample = 8,
                                   uint64_t seed = 0);

} // namespace dtensor
