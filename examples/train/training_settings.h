#pragma once

// The recipe's training settings (docs/recipe.md, "Training settings"): the optimizer and its
// learning-rate schedule from the flags, with torchtitan's names and defaults; the seed and
// deterministic mode.
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "llama_flags.h"
#include "lr_scheduler.h"

namespace dtensor::train {

// torchtitan's optimizers by name (Adam, AdamW), every parameter in one group; Muon: the
// matrices of `model` among `params` (this rank's) by Muon, the rest (embeddings, norms, the
// output projection) by AdamW with the same learning rate and weight decay.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Flags& f,
                                                        const torch::nn::Module& model,
                                                        const std::vector<at::Tensor>& params);

// The learning-rate schedule of the flags (its length: --lr-total-steps, else --steps).
WarmupStableDecayOptions schedule_options(const Flags& f);

// "AdamW lr 0.003 (betas 0.9/0.95, weight decay 0.1), warmup 2, linear decay over ...".
std::string describe_optimizer(const Flags& f, const LrPhases& phases);

// torchtitan's deterministic mode: deterministic kernels only (an op without one raises),
// cuDNN's deterministic algorithms without autotuning, cuBLAS's fixed workspace (read when
// cuBLAS starts: call before any GPU work).
void use_deterministic_algorithms();

} // namespace dtensor::train
