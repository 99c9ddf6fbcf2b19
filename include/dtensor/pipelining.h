#pragma once

// Pipeline parallelism (docs/pipeline.md): a model cut into stages on the ranks of a pipeline
// group, microbatches run through them in the order of a schedule
// (dtensor/pipeline_schedule.h). Activations and their gradients move between ranks by
// point-to-point transfers through the collective choke point (CommDebugMode counts them).
//
//   auto pp = mesh.get_group("pp");
//   dtensor::PipelineStage stage{index, module, [&](const at::Tensor& x) { return
//   module->forward(x); }}; auto order =
//   dtensor::generate_schedule(dtensor::ScheduleKind::OneFOneB, pp.size(), 8);
//   dtensor::PipelineSchedule schedule({stage}, pp, order, 8, loss_fn);
//   auto losses = schedule.step(tokens, targets); // gradients accumulate into the stages
//
// The loss contract, PyTorch's (`scale_grads`): the loss of a microbatch is what its backward
// starts from, and after a stage's last backward of the step (and its gradient reduction) its
// parameters' gradients are divided by the number of microbatches, so a mean loss over equal
// microbatches gives the gradients of the model without pipelining. With a sum loss divided by
// the batch's global token count (torchtitan's), set scale_grads(false).

#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <dtensor/device_mesh.h>
#include <dtensor/pipeline_schedule.h>
#include <dtensor/process_group.h>

namespace dtensor {

// One stage of the model on this rank: its index among all stages, the module holding its
// parameters, and its computation (one tensor in, one out: token ids to hidden states on the
// first stage, hidden states to logits on the last). A stage whose input is a DTensor
// (sequence-parallel hidden states) names the mesh it rebuilds it on: its tensor-parallel
// mesh (only the local tensor travels between stages, docs/pipeline.md).
struct PipelineStage {
  PipelineStage(int index_, std::shared_ptr<torch::nn::Module> module_,
                std::function<at::Tensor(const at::Tensor&)> forward_, DeviceMesh mesh_ = {})
      : index(index_), module(std::move(module_)), forward(std::move(forward_)),
        mesh(std::move(mesh_)) {}
  int index = 0;
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  DeviceMesh mesh;
};

// The last stage's output for one microbatch and that microbatch's target -> a scalar loss.
using PipelineLoss = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;

struct PipelineOptions {
  // [Note: mean_over_microbatches is gone] The former option divided each microbatch's loss
  // before its backward, off by default, where PyTorch's scale_grads divides the gradients
  // after, on by default: code written for either would silently get M times the other's
  // gradients. A call does not compile, naming scale_grads.
  template <typename Removed = void>
  PipelineOptions& mean_over_microbatches(bool /*unused*/) {
    static_assert(!std::is_void_v<Removed>,
                  "PipelineOptions::mean_over_microbatches is removed: use PyTorch's scale_grads "
                  "(default true: gradients divided by the number of microbatches after the "
                  "last backward; false for a sum loss)");
    return *this;
  }

  // PyTorch's scale_grads, with its default: after a stage's last backward of the step (B or
  // W) and its gradient reduction (WAIT_REDUCE_GRAD), every gradient of the stage's module is
  // divided in place by the number of microbatches (all of .grad, as PyTorch's
  // `_PipelineStageBase.scale_grads`: gradients accumulated over earlier steps without zeroing
  // are divided again). Right for a loss that is a mean over its microbatch; false for a sum
  // loss over the global count (docs/pipeline.md, "The loss contract").
  TORCH_ARG(bool, scale_grads) = true;
  // Record when each compute action of this rank ran (PipelineSchedule::last_step_timeline):
  // the measured side of the timed simulation (simulate_schedule), for calibration.
  TORCH_ARG(bool, record_timeline) = false;
  TORCH_ARG(LoweringOptions, lowering) = {};
  // [Note: a communicator per pipeline edge] Activations and input gradients of each stage
  // boundary travel on a two-rank communicator of their own per direction, instead of the
  // pipeline group. nullopt: per edge on NCCL, where a communicator's transfers to one peer
  // share one stream (a receive posted ahead would hold up an unrelated send queued behind
  // it); the pipeline group on Gloo, whose pairs are independent already.
  TORCH_ARG(std::optional<bool>, group_per_edge) = std::nullopt;
  // Called before every forward and every backward (B, I, W) of one of this rank's stages on
  // a microbatch, with the stage's index and the microbatch's (the first step's shape pass
  // included, as microbatch 0): where a microbatch's own state is set on the modules the
  // stage reads, as torchtitan hands each microbatch its extra arguments (its attention
  // masks). Before a backward too, because activation checkpointing recomputes the forward
  // there, reading the same state.
  TORCH_ARG(std::function<void(int, int)>, before_compute) = nullptr;
};

class PipelineSchedule {
 public:
  // `stages`: this rank's stages; `group`: the pipeline group (its ranks are the pipeline
  // ranks of `compute`); `compute`: every rank's compute actions (generate_schedule, or a
  // CSV through schedule_from_csv). The schedule is checked and lowered here: one that
  // deadlocks, or that places on this rank other stages than `stages`, is refused naming
  // them.
  PipelineSchedule(std::vector<PipelineStage> stages, Group group, const PipelineOrder& compute,
                   int microbatches, PipelineLoss loss, PipelineOptions options = {});
  ~PipelineSchedule();
  PipelineSchedule(const PipelineSchedule&) = delete;
  PipelineSchedule& operator=(const PipelineSchedule&) = delete;

  // One step: `input` (read on the rank of stage 0) and `target` (on the rank of the last
  // stage) split along dim 0 into the microbatches; every rank given either checks that it
  // splits. Returns the microbatches' losses (as loss_fn gave them) on the last stage's rank,
  // none elsewhere; gradients accumulate into the stages' parameters (scale_grads). Called on
  // every rank of the group: the first step agrees, before any transfer, on the number of
  // stages, the lowered program, the options the ranks share and whether each rank's batch
  // splits, and a disagreement or a bad batch raises the same dtensor::Error on every rank,
  // naming each rank and what it had ([Note: agreeing before the first step] in runtime.cpp).
  // Any other failure names the pipeline rank, the stage and the action.
  std::vector<at::Tensor> step(const at::Tensor& input, const at::Tensor& target);

  // The lowered program of every pipeline rank (lower_schedule).
  const PipelineOrder& program() const;
  // With record_timeline: this rank's compute actions (F, B, I, W) of the last step, each
  // from when its input was there to its end, in seconds since the step began; the step's
  // wall time is last_step_seconds(). Empty otherwise.
  const std::vector<TimedAction>& last_step_timeline() const;
  double last_step_seconds() const;
  // Receive buffers the last step allocated: reused as the activations and gradients they
  // held die, so their number is the step's peak of live receives, not the microbatch count.
  // They are let go of when the step ends.
  int64_t receive_buffer_count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace dtensor
