#pragma once

// torchtitan's learning-rate schedule (docs/recipe.md, "Training settings"): a linear warmup,
// a stable phase, then a linear, square-root or cosine decay towards `min_lr_factor` x the
// optimizer's learning rate (warmup-stable-decay, arXiv 2404.06395), as a LibTorch scheduler.
// A part of the trainer, as in torchtitan (its components/lr_scheduler), not of the library.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/optim/schedulers/lr_scheduler.h>

namespace dtensor::train {

enum class LrDecay { Linear, Sqrt, Cosine };

// "linear" / "sqrt" / "cosine"; std::invalid_argument naming the value otherwise.
LrDecay lr_decay_from_name(const std::string& name);

struct WarmupStableDecayOptions {
  // The schedule's length in optimizer steps (torchtitan: lr_scheduler.total_steps, else
  // training.steps).
  TORCH_ARG(int64_t, total_steps) = 0;
  TORCH_ARG(int64_t, warmup_steps) = 200;
  // The share of total_steps that decays; nullopt: the decay starts right after the warmup.
  TORCH_ARG(std::optional<double>, decay_ratio) = std::nullopt;
  TORCH_ARG(LrDecay, decay_type) = LrDecay::Linear;
  TORCH_ARG(double, min_lr_factor) = 0.0;
};

// The phases' lengths, clamped as torchtitan clamps them: the warmup to total_steps, the decay
// to what the warmup leaves. `stable` counts one step past the end ([Note: the virtual last
// step] in lr_scheduler.cpp).
struct LrPhases {
  int64_t warmup = 0, stable = 0, decay = 0;
};
LrPhases lr_phases(const WarmupStableDecayOptions& options);

// The factor on the optimizer's learning rate after `steps` optimizer steps (torchtitan's
// LambdaLR lambda at last_epoch = steps): the step after them runs at lr x this factor.
double warmup_stable_decay_factor(int64_t steps, const LrPhases& phases, LrDecay decay,
                                  double min_lr_factor);

// The schedule on every parameter group of `optimizer`: constructed, it sets each group's
// learning rate to its own x factor(0) (as PyTorch's LambdaLR does on construction); each
// step() after optimizer.step() moves to the next step's. The groups' learning rates when
// constructed are the base ones (keep the optimizer's options at the peak value).
class WarmupStableDecayLR : public torch::optim::LRScheduler {
 public:
  WarmupStableDecayLR(torch::optim::Optimizer& optimizer, WarmupStableDecayOptions options);

  // The optimizer steps taken (torchtitan's last_epoch), and a resumed run's way back to them.
  int64_t steps_taken() const { return static_cast<int64_t>(step_count_); }
  void set_steps_taken(int64_t steps);
  // The learning rate of each group for the next optimizer step.
  std::vector<double> current_lrs() const { return get_current_lrs(); }
  const LrPhases& phases() const { return phases_; }

 private:
  std::vector<double> get_lrs() override;
  std::vector<double> lrs_at(int64_t steps) const;

  torch::optim::Optimizer& optimizer_;
  WarmupStableDecayOptions options_;
  LrPhases phases_;
  std::vector<double> base_lrs_;
};

} // namespace dtensor::train
