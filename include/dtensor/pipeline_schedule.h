#pragma once

// Pipeline schedules as data (docs/pipeline.md): the actions each pipeline rank runs, in
// PyTorch's notation (torch.distributed.pipelining): `2F0` is the forward of stage 2 on
// microbatch 0, `1B3` a full backward, `0I1` / `0W1` the input- and weight-gradient halves of
// a split (zero-bubble) backward, `1UNSHARD` / `1RESHARD` fully_shard's all-gather and free of
// a stage, `3SEND_F1` / `2RECV_F1` the activation's point-to-point transfer, `0REDUCE_GRAD`
// the stage's gradient reduction after its last backward, `(0F3;1B2)OVERLAP_F_B` a forward
// and a backward run as one step (DualPipeV).
//
// A schedule is generated per kind (GPipe, 1F1B, Interleaved 1F1B, LoopedBFS, Interleaved
// zero-bubble, ZBV zero-bubble, DualPipeV) as compute actions per rank, with idle steps
// where ranks wait in lock step; `lower_schedule` adds the communication and fully_shard
// actions. Both forms read and write PyTorch's CSV layout (one row per rank, one action per
// cell, an idle step as an empty cell), so a schedule exported here loads in PyTorch's
// `_load_csv` and a custom CSV schedule loads here. Every bad input (an unknown action, a
// microbatch count a schedule cannot take, a backward before its forward, a stage on two
// ranks, a schedule that cannot progress) throws dtensor::Error naming the rank, the step
// and the action.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <torch/arg.h>

namespace dtensor {

enum class ActionType : std::uint8_t {
  Forward,        // F
  BackwardInput,  // I
  BackwardWeight, // W
  FullBackward,   // B
  Unshard,        // UNSHARD
  Reshard,        // RESHARD
  SendF,          // SEND_F
  RecvF,          // RECV_F
  SendB,          // SEND_B
  RecvB,          // RECV_B
  WaitSendF,      // WAIT_SEND_F
  WaitSendB,      // WAIT_SEND_B
  ReduceGrad,     // REDUCE_GRAD
  WaitReduceGrad, // WAIT_REDUCE_GRAD
  OverlapFB,      // OVERLAP_F_B: sub_actions run as one step
};

// The notation's name of a type ("F", "SEND_F", ...).
std::string_view action_type_name(ActionType type);

struct PipelineAction {
  int stage = -1; // -1 for OVERLAP_F_B, whose sub-actions carry the stages
  ActionType type = ActionType::Forward;
  std::optional<int> microbatch; // none for UNSHARD, RESHARD, REDUCE_GRAD, WAIT_REDUCE_GRAD
  std::vector<PipelineAction> sub_actions;

  // `2F0`, `1UNSHARD`, `(0F3;1B2)OVERLAP_F_B`.
  std::string str() const;
  // The inverse of str(); the whole text must be one action (PyTorch accepts `0FX` as `0F`).
  static PipelineAction parse(std::string_view text);
  bool is_compute() const; // F, I, W, B, OVERLAP_F_B

  friend bool operator==(const PipelineAction&, const PipelineAction&) = default;
};

// One rank's actions in order; std::nullopt is an idle step of the lock-step generators.
using RankActions = std::vector<std::optional<PipelineAction>>;
// Every rank's actions, indexed by pipeline rank.
using PipelineOrder = std::vector<RankActions>;

enum class ScheduleKind : std::uint8_t {
  GPipe,
  OneFOneB,
  Interleaved1F1B,
  LoopedBFS,
  InterleavedZeroBubble,
  ZBVZeroBubble,
  DualPipeV,
};

// PyTorch's names, case-insensitive: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
// InterleavedZeroBubble, ZBVZeroBubble, DualPipeV.
ScheduleKind schedule_kind(std::string_view name);
std::string_view schedule_name(ScheduleKind kind);
// GPipe and 1F1B run one stage per rank; the others any number (ZBV and DualPipeV two).
bool is_single_stage(ScheduleKind kind);
// Where each stage runs: stage s on rank s % pp ("loop"), or the V of ZBV and DualPipeV
// (rank r holds stages r and 2 pp - 1 - r).
std::vector<int> stage_to_rank(ScheduleKind kind, int pp, int num_stages);

// The compute actions of every rank for pp ranks, `microbatches` microbatches and
// `stages_per_rank` stages on each rank, as PyTorch 2.15 generates them (idle steps
// included), but for 1F1B's last rank, where PyTorch's exported order numbers the forwards
// from 1 (its runtime runs them from 0, as here). Throws when the schedule cannot take the
// shape (1F1B: microbatches >= pp; Interleaved: microbatches a multiple of the rounds;
// ZBV, DualPipeV: two stages per rank; DualPipeV: microbatches >= 2 pp).
PipelineOrder generate_schedule(ScheduleKind kind, int pp, int microbatches,
                                int stages_per_rank = 1);

// Checks a compute schedule as PyTorch's _validate_schedule does (every backward after its
// forward, every W after its I, each stage on one rank, each stage's forward and backward
// counts equal to `microbatches`) and returns the stage -> rank placement it implies.
std::vector<int> validate_schedule(const PipelineOrder& order, int num_stages, int microbatches);

struct LoweringOptions {
  // Stages of one rank that may be unsharded at once; more are resharded as the schedule
  // moves on.
  TORCH_ARG(int, max_active_stages) = 3;
  // Stages unsharded ahead of their compute (at most max_active_stages); 0: all of them
  // ("full", PyTorch's default).
  TORCH_ARG(int, unshard_lookahead) = 0;
};

// Compute actions -> the full program of each rank, as PyTorch's runtime lowers them:
// UNSHARD/RESHARD with the lookahead, REDUCE_GRAD + WAIT_REDUCE_GRAD after a stage's last
// backward, SEND/RECV between stages on different ranks (receives posted as soon as the
// sender computes), and WAIT_SEND after the local action that proves the peer received.
// Idle steps are dropped. `num_stages` is the total over ranks.
PipelineOrder lower_schedule(const PipelineOrder& compute, int num_stages, int microbatches,
                             const LoweringOptions& options = {});

// PyTorch's CSV layout: one row per rank, one action per cell, an idle step as an empty cell.
std::string schedule_to_csv(const PipelineOrder& order);
// Parses the CSV; `file` names the source in errors ("<csv>" when empty). A compute-only
// schedule (F, I, W, B, OVERLAP_F_B and empty cells) is what `lower_schedule` takes.
PipelineOrder schedule_from_csv(std::string_view text, std::string_view file = {});
// One line per rank, actions comma-separated, idle steps as "_": how tests compare orders.
std::string schedule_to_text(const PipelineOrder& order);

// Per-action costs of the timed simulation (any unit: seconds, or 1 per forward).
struct ScheduleCosts {
  TORCH_ARG(double, forward) = 1.0;
  TORCH_ARG(double, backward_input) = 1.0;
  TORCH_ARG(double, backward_weight) = 1.0;
  TORCH_ARG(double, full_backward) = 2.0;
  // An OVERLAP_F_B step; 0: its forward and full backward one after the other.
  TORCH_ARG(double, overlapped_f_b) = 0.0;
  // From the end of an action to its output's arrival on another rank.
  TORCH_ARG(double, p2p_latency) = 0.0;
  // When set, the cost of each compute action (F, I, W, B, or a whole OVERLAP_F_B), in place
  // of the per-type costs above: costs per stage (a last stage with the output layer and the
  // loss, uneven layer splits) or per microbatch, e.g. calibrated from a measured run's
  // PipelineSchedule::last_step_timeline(). A negative result falls back to the per-type
  // cost.
  TORCH_ARG(std::function<double(const PipelineAction&)>, action_cost);
};

struct TimedAction {
  int rank = 0;
  PipelineAction action;
  double start = 0.0;
  double end = 0.0;
};

struct ScheduleTimeline {
  double makespan = 0.0;
  // 1 - (busy time of all ranks) / (ranks x makespan).
  double bubble_fraction = 0.0;
  std::vector<double> busy; // per rank
  // Per rank: the most (stage, microbatch) activations held at once, from the start of a
  // forward to the end of its full backward or, split, its weight gradient (W).
  std::vector<int> peak_activations;
  std::vector<TimedAction> actions; // in the order simulated
};

// Times a compute schedule (idle steps are ignored; each rank runs its actions in order,
// each as soon as its inputs exist: a forward after the previous stage's forward of the
// microbatch, a backward after the next stage's, a W after its I, plus p2p_latency between
// ranks). Throws if the schedule cannot complete, naming each waiting rank, its action and
// the action it waits for.
ScheduleTimeline simulate_schedule(const PipelineOrder& compute, int num_stages,
                                   const ScheduleCosts& costs = {});

} // namespace dtensor
