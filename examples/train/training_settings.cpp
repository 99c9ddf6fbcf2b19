// The recipe's training settings (training_settings.h).
#include "training_settings.h"

#include <cstdio>
#include <cstdlib>
#include <set>

#include <ATen/Context.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <dtensor/muon.h>

namespace dtensor::train {

namespace {

std::unique_ptr<torch::optim::Optimizer> make_muon(const Flags& f, const torch::nn::Module& model,
                                                   const std::vector<at::Tensor>& params) {
  std::set<const void*> held;
  for (const auto& p : params) {
    held.insert(p.unsafeGetTensorImpl());
  }
  auto groups = optim::muon_param_groups(
      model,
      optim::MuonOptions(f.lr)
          .weight_decay(f.weight_decay)
          .momentum(f.muon_momentum)
          .adjust_lr_fn(f.muon_adjust_lr),
      torch::optim::AdamWOptions(f.lr).betas({f.beta1, f.beta2}).eps(f.eps).weight_decay(
          f.weight_decay));
  for (auto& g : groups) {
    std::vector<at::Tensor> mine;
    for (const auto& p : g.params()) {
      if (held.count(p.unsafeGetTensorImpl()) != 0) {
        mine.push_back(p);
      }
    }
    g.params() = std::move(mine);
  }
  return std::make_unique<optim::Muon>(groups);
}

} // namespace

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Flags& f,
                                                        const torch::nn::Module& model,
                                                        const std::vector<at::Tensor>& params) {
  if (f.optimizer == "Muon") {
    return make_muon(f, model, params);
  }
  if (f.optimizer == "Adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(f.lr)
                    .betas({f.beta1, f.beta2})
                    .eps(f.eps)
                    .weight_decay(f.weight_decay));
  }
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(f.lr)
                                                           .betas({f.beta1, f.beta2})
                                                           .eps(f.eps)
                                                           .weight_decay(f.weight_decay));
}

WarmupStableDecayOptions schedule_options(const Flags& f) {
  return WarmupStableDecayOptions()
      .total_steps(f.lr_total_steps > 0 ? f.lr_total_steps : f.steps)
      .warmup_steps(f.warmup_steps)
      .decay_ratio(f.decay_ratio)
      .decay_type(lr_decay_from_name(f.decay_type))
      .min_lr_factor(f.min_lr_factor);
}

std::string describe_optimizer(const Flags& f, const LrPhases& p) {
  char text[320];
  const std::string muon = f.optimizer != "Muon"
                               ? std::string()
                               : " with momentum " + std::to_string(f.muon_momentum).substr(0, 4) +
                                     ", " + f.muon_adjust_lr + "; AdamW for the rest";
  std::snprintf(text, sizeof text,
                "%s%s lr %g (betas %g/%g, weight decay %g), warmup %lld, %s decay over %lld "
                "steps to %g x lr",
                f.optimizer.c_str(), muon.c_str(), f.lr, f.beta1, f.beta2, f.weight_decay,
                static_cast<long long>(p.warmup), f.decay_type.c_str(),
                static_cast<long long>(p.decay), f.min_lr_factor);
  return text;
}

void use_deterministic_algorithms() {
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
}

} // namespace dtensor::train
