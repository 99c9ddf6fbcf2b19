#pragma once

// The pipeline runtime's state (PipelineSchedule::Impl), shared by runtime.cpp (running the
// program: compute, data parallelism) and transfers.cpp (point-to-point transfers and their
// buffers and communicators). Internal to lib/parallel/pipelining.
#include <dtensor/pipelining.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/nn/module.h>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>
#include <dtensor/fully_shard.h>
#include <dtensor/replicate.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "parallel/pipelining/activations.h"
#include "parallel/pipelining/schedule_parts.h"

namespace dtensor {

namespace detail {

// A stage's data parallelism: its fully_shard units ([Note: fully_shard under pipelining])
// and replicate() handles.
struct StageUnits {
  std::optional<FSDPModule> root;
  std::vector<FSDPModule> units; // root included
  GradientReductionHandle reduction;
  std::vector<ReplicateHandle> replicas; // replicate() inside the stage
  int weight_backwards = 0;              // this step's B and W so far
};

} // namespace detail

struct PipelineSchedule::Impl {
  using AT = ActionType;
  using Clock = std::chrono::steady_clock;
  using Slot = std::pair<int, int>; // stage, microbatch
  using Shape = detail::StageShape;
  static constexpr int kMetaTag = 1 << 24;

  std::map<int, PipelineStage> stages;        // this rank's, by index
  std::map<int, detail::StageUnits> dp_units; // the same stages'
  Group group;
  int microbatches = 0;
  int num_stages = 0;
  PipelineLoss loss;
  PipelineOptions options;
  std::vector<int> placement; // stage -> pipeline rank
  PipelineOrder program;
  bool per_edge = false; // [Note: a communicator per pipeline edge], resolved
  bool agreed = false;   // [Note: agreeing before the first step]
  bool shapes_known = false;
  std::map<int, detail::StageShape> in_shape, out_shape; // per local stage

  // Per step.
  std::vector<at::Tensor> input_mbs, target_mbs, losses;
  Clock::time_point step_start;
  std::optional<Clock::time_point> compute_start; // the running compute action's, once its
                                                  // input is there (record_timeline)
  std::vector<TimedAction> timeline;
  double step_seconds = 0.0;
  std::map<Slot, at::Tensor> inputs, outputs, grad_outputs, input_grads;
  // [Note: releasing sent tensors] Outputs let go of after their send: the autograd edge
  // their backward starts from.
  std::map<Slot, torch::autograd::Edge> released;
  // [Note: receive buffers] Every receive buffer this schedule allocated. A receive takes one
  // of the right size and dtype that nothing else refers to any more (its storage's only
  // owner is this list: the forward that read it and the backward that saved it are done, or
  // the gradient it held has been used), else allocates one: buffers follow the liveness of
  // the activations and gradients they hold, instead of one per microbatch (pytorch#136380;
  // PyTorch allocates each just before its receive). A tensor a caller keeps alive is never
  // reused. The list grows to the step's peak of live receives and is let go of when the step
  // ends: between steps (the optimizer's step, whose own peak may be the job's) no receive
  // buffer is held, as in PyTorch.
  std::vector<at::Tensor> recv_pool;
  int64_t recv_buffers = 0; // the last step's recv_pool size, for receive_buffer_count()
  // [Note: a communicator per pipeline edge] (boundary, forward) -> its group; empty: all on
  // `group`.
  std::map<std::pair<int, bool>, Group> edges;
  // Posted receives and sends in flight: (type, stage, microbatch) -> (work, its tensor).
  std::map<std::tuple<AT, int, int>, std::pair<Work, at::Tensor>> in_flight;
  // [Note: sends a receive proves received] A receive of this rank -> this rank's sends to the
  // same peer whose matching receives the peer posts before it sends what this one receives.
  std::map<std::tuple<AT, int, int>, std::vector<std::tuple<AT, int, int>>> proven_by;

  bool is_local(int stage) const { return stages.count(stage) > 0; }
  int tag(bool fwd, int stage, int mb) const {
    return ((stage * 2 + (fwd ? 0 : 1)) * microbatches + mb) + 1;
  }

  // "pipeline rank 1 (pp: ranks [0, 1] (gloo))": how errors name this rank; its stages "1, 2".
  std::string rank_name() const;
  std::string stage_list() const;
  // Splits the batch into the microbatches this rank reads; "" or why it does not split.
  std::string split_batch(const at::Tensor& input, const at::Tensor& target);
  void agree_first_step(const std::string& bad_batch);
  void find_shapes();
  void scale_grads(int s);
  void find_units(int s);
  void run_data_parallel(AT type, int s);
  void run(const PipelineAction& a);
  void record(const PipelineAction& a);
  void forward(int s, int mb);
  void backward(AT type, int s, int mb);
  void post_recv(bool fwd, int s, int mb);
  at::Tensor recv_buffer(const Shape& shape);
  void post_send(bool fwd, int s, int mb);
  void wait_send(bool fwd, int s, int mb);
  void release_sent();
  void release(const std::tuple<AT, int, int>& key, std::pair<Work, at::Tensor>& entry);
  at::Tensor take_recv(bool fwd, int s, int mb);
  void check_done();
  void make_edge_groups();
  void find_proven_sends();
  // The communicator of a transfer across boundary b (stage b to b+1) and the peer's rank in
  // it: `to_next` when the peer holds stage b + 1.
  std::pair<const Group*, int> route(int b, bool fwd, bool to_next) const;
};

} // namespace dtensor
