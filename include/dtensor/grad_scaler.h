#pragma once

// Gradient scaling for fp16 training, with torch.amp.GradScaler's semantics, on plain,
// sparse and DTensor gradients (fully_shard, tensor parallelism, FSDP x TP, gradients on
// several meshes). See docs/grad_scaler.md.
//
//   dtensor::GradScaler scaler;
//   auto loss = scaler.scale(model->forward(x).sum());
//   loss.backward();
//   scaler.unscale_(opt);                 // optional: before clip_grad_norm_
//   bool stepped = scaler.step(opt);      // false: a gradient somewhere was inf / NaN
//   scaler.update();
#include <cstdint>
#include <optional>
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/arg.h>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace dtensor {

struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;
};

// What state_dict() saves and load_state_dict() restores (PyTorch's keys).
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // outputs * scale. The scale lives on the first output's device (created there on first
  // use). The IValue form scales nested containers (lists, tuples, tensor lists) of tensors
  // and returns the same structure. Disabled: the outputs unchanged.
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);
  c10::IValue scale(const c10::IValue& outputs);

  // Divides the optimizer's gradients by the scale in place (local shards of DTensor
  // gradients, values of sparse ones, fp16 included; sparse fp16 gradients are coalesced
  // first, so duplicate indices that overflow when summed are found), and agrees across
  // ranks whether any gradient anywhere is inf / NaN: one all-reduce (max) per mesh
  // dimension that some DTensor gradient is sharded or partial on, over the union of all
  // gradients' meshes ([Note: agreeing on found-inf] in lib/train/grad_scaler.cpp). At most once
  // per optimizer between update() calls.
  void unscale_(torch::optim::Optimizer& optimizer);

  // Unscales if unscale_ was not called, then runs optimizer.step() unless a non-finite
  // gradient was found. Returns whether the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer);

  // Grows the scale after growth_interval clean steps, backs it off after a step with a
  // non-finite gradient (at::_amp_update_scale_), or sets `new_scale`. Resets every
  // optimizer's unscale / step state.
  void update(std::optional<double> new_scale = std::nullopt);

  // The agreed found-inf flag (1.0 / 0.0, on the gradients' device) of the last unscale_ of
  // `optimizer` since update(); undefined before.
  at::Tensor found_inf(const torch::optim::Optimizer& optimizer) const;

  double get_scale() const; // 1.0 when disabled; init_scale before the first scale()
  double get_growth_factor() const { return options_.growth_factor(); }
  double get_backoff_factor() const { return options_.backoff_factor(); }
  int64_t get_growth_interval() const { return options_.growth_interval(); }
  int64_t get_growth_tracker() const;
  bool is_enabled() const { return options_.enabled(); }

  GradScalerState state_dict() const;
  void load_state_dict(const GradScalerState& state);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    at::Tensor found_inf; // agreed, on the gradients' device
  };
  void lazy_init(const at::Device& device);
  PerOptimizer& state_of(const torch::optim::Optimizer& optimizer);

  GradScalerOptions options_;
  at::Tensor scale_;          // float32 scalar, created on first use
  at::Tensor growth_tracker_; // int32 scalar next to it
  std::unordered_map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

} // namespace dtensor
