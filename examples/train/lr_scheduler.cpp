// torchtitan's warmup-stable-decay learning-rate schedule (lr_scheduler.h).
#include "lr_scheduler.h"

#include <cmath>
#include <numbers>
#include <stdexcept>

#include <torch/optim/optimizer.h>

namespace dtensor::train {

namespace {

void check(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument(what);
  }
}

} // namespace

LrDecay lr_decay_from_name(const std::string& name) {
  if (name == "linear") {
    return LrDecay::Linear;
  }
  if (name == "sqrt") {
    return LrDecay::Sqrt;
  }
  check(name == "cosine",
        "lr_scheduler.decay_type: \"" + name + "\" is not one of linear, sqrt, cosine");
  return LrDecay::Cosine;
}

// [Note: the virtual last step]
// torchtitan sizes the stable phase as total + 1 - warmup - decay: one step past the run's
// end belongs to it, so the decay's progress at the run's last step is (decay - 1) / decay and
// the learning rate never reaches min_lr_factor x lr within the run (with decay_ratio unset,
// one stable step at the peak sits between the warmup and the decay). The decay's length is
// round(total x decay_ratio) with Python's rounding (halves to even: std::nearbyint under the
// default rounding mode).
LrPhases lr_phases(const WarmupStableDecayOptions& o) {
  check(o.total_steps() >= 0 && o.warmup_steps() >= 0,
        "lr_scheduler: total_steps " + std::to_string(o.total_steps()) + " and warmup_steps " +
            std::to_string(o.warmup_steps()) + " must not be negative");
  check(!o.decay_ratio() || (*o.decay_ratio() >= 0 && *o.decay_ratio() <= 1),
        "lr_scheduler.decay_ratio " + std::to_string(o.decay_ratio().value_or(0)) +
            " is not within [0, 1]");
  check(o.min_lr_factor() >= 0 && o.min_lr_factor() <= 1,
        "lr_scheduler.min_lr_factor " + std::to_string(o.min_lr_factor()) +
            " is not within [0, 1]");
  LrPhases p;
  p.warmup = std::min(o.warmup_steps(), o.total_steps());
  if (o.decay_ratio()) {
    const auto decay =
        static_cast<int64_t>(std::nearbyint(static_cast<double>(o.total_steps()) * *o.decay_ratio()));
    p.decay = std::min(decay, o.total_steps() - p.warmup);
  } else {
    p.decay = o.total_steps() - p.warmup;
  }
  p.stable = o.total_steps() + 1 - p.warmup - p.decay;
  return p;
}

double warmup_stable_decay_factor(int64_t steps, const LrPhases& p, LrDecay decay,
                                  double min_lr_factor) {
  if (steps < p.warmup) {
    return static_cast<double>(steps + 1) / static_cast<double>(p.warmup);
  }
  if (steps < p.warmup + p.stable) {
    return 1.0;
  }
  const double progress =
      static_cast<double>(steps + 1 - p.warmup - p.stable) / static_cast<double>(p.decay);
  double a = 1.0 - progress;
  if (decay == LrDecay::Sqrt) {
    a = 1.0 - std::sqrt(progress);
  } else if (decay == LrDecay::Cosine) {
    a = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  }
  return min_lr_factor + (1.0 - min_lr_factor) * a;
}

WarmupStableDecayLR::WarmupStableDecayLR(torch::optim::Optimizer& optimizer,
                                         WarmupStableDecayOptions options)
    : LRScheduler(optimizer),
      optimizer_(optimizer),
      options_(options),
      phases_(lr_phases(options)),
      base_lrs_(get_current_lrs()) {
  set_steps_taken(0);
}

void WarmupStableDecayLR::set_steps_taken(int64_t steps) {
  check(steps >= 0, "WarmupStableDecayLR: " + std::to_string(steps) + " steps taken");
  step_count_ = static_cast<unsigned>(steps);
  const std::vector<double> lrs = lrs_at(steps);
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    groups[i].options().set_lr(lrs[i]);
  }
}

// LRScheduler::step() sets these, then counts the step.
std::vector<double> WarmupStableDecayLR::get_lrs() {
  return lrs_at(static_cast<int64_t>(step_count_) + 1);
}

std::vector<double> WarmupStableDecayLR::lrs_at(int64_t steps) const {
  const double factor =
      warmup_stable_decay_factor(steps, phases_, options_.decay_type(), options_.min_lr_factor());
  std::vector<double> out;
  out.reserve(base_lrs_.size());
  for (const double base : base_lrs_) {
    out.push_back(base * factor);
  }
  return out;
}

} // namespace dtensor::train
