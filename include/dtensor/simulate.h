#pragma once

// Planning a job before running it: what one rank of a (simulated or real) world allocates,
// computes and sends in a training step, and whether every rank of every group issues the
// same collectives (docs/simulation.md). The simulated world itself is a process group
// setting ([Note: simulated worlds] in dtensor/process_group.h).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <dtensor/collective_cost.h>
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
  int64_t work_flops = 0; // what the kernels execute: flops less causal attention's masked part
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
  int64_t tokens = 0;          // tokens the whole world trains on in this step (0: unknown)
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

// [Note: the time model] A step's predicted time on a GPU cluster, from a rank's report
// (docs/simulation.md "The model of time"). Compute: the phase's work FLOPs (causal
// attention's masked part skipped) at `achieved_tflops`. A collective over k ranks: the
// ring's alpha-beta time on the slowest link it crosses (within one node of
// `ranks_per_node`: NVLink; else the network): all-gather and reduce-scatter (k-1) alpha +
// (k-1)/k bytes / bw (the gathered, resp. the scattered size), all-reduce twice that,
// all-to-all as all-gather, broadcast alpha + bytes / bw, a send alpha + bytes / (p2p_gbps
// when set, else bw), a receive alpha (links are full duplex: its bytes are the sender's
// time). Overlap as the schedule issues it, on a timeline: compute runs from one collective's
// issue point (CollectiveRecord::issued_at) to the next; each group's collectives queue on
// its own stream (NCCL's stream per process group); a synchronous collective stalls compute
// until it is done; an asynchronous one runs beside compute until its wait
// (CollectiveRecord::waited_at, where the recorder saw Work::wait), or, without one, until
// the next collective of its kind in its group is issued, where compute waits for it, or
// until the phase ends.
// Defaults: an H100 SXM node of 8 with NVLink and 400 Gb/s per GPU across nodes.
struct TimeModelOptions {
  TORCH_ARG(double, achieved_tflops) = 400;     // bf16 FLOP/s the kernels achieve, in 1e12
  TORCH_ARG(int64_t, ranks_per_node) = 8;       // GPUs sharing NVLink
  TORCH_ARG(double, intra_node_gbps) = 360;     // NCCL bus bandwidth in a node, GB/s per GPU
  TORCH_ARG(double, inter_node_gbps) = 45;      // ... across nodes, GB/s per GPU
  TORCH_ARG(double, intra_node_latency_us) = 8; // per ring step in a node
  TORCH_ARG(double, inter_node_latency_us) = 20;
  // A send's GB/s to one peer, where a point-to-point transfer has less than the collectives'
  // bus bandwidth (a torus: a ring neighbour is one link, a collective uses them all); 0: the
  // link's bandwidth above (NVLink's switch and the network give one peer the same).
  TORCH_ARG(double, p2p_gbps) = 0;
  // A row of the device / network table (dtensor/collective_cost.h): each collective then costs
  // what NCCL's tuner predicts for its cheapest algorithm on that cluster (ring, tree, NVLS...;
  // [Note: collectives by algorithm]), nodes of the row's gpus_per_node, instead of the ring's
  // alpha-beta above. Unset: the ring.
  TORCH_ARG(std::optional<ClusterSpec>, cluster) = std::nullopt;
};

struct PhaseTime {
  std::string name;
  double compute_s = 0;    // work FLOPs / achieved rate
  double sync_comm_s = 0;  // synchronous collectives, each compute waits for
  double async_comm_s = 0; // asynchronous collectives, running beside compute
  double total_s = 0;      // the timeline: compute, its stalls, and the last collective's end
};

struct StepTime {
  std::vector<PhaseTime> phases;
  double total_s = 0;
  double tokens_per_second_per_rank = 0; // report.tokens / world / total (0 without tokens)
};

// One collective's predicted seconds ([Note: the time model]).
double collective_seconds(const CollectiveRecord& c, const TimeModelOptions& options);
StepTime predict_step_time(const RankReport& report,
                           const TimeModelOptions& options = TimeModelOptions());

} // namespace dtensor
