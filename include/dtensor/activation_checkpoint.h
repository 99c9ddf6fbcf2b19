#pragma once

// Activation checkpointing for LibTorch modules (docs/activation_checkpoint.md): PyTorch's
// torch.utils.checkpoint, for C++. A checkpointed function keeps none of its activations
// after forward, only its inputs; backward runs it again (the recompute) and takes the
// gradients from the recomputed graph. Random numbers are replayed, so dropout masks are the
// same in the recompute as in forward; under fully_shard the recompute uses the unit
// unsharded by backward (the all-gather backward does anyway), under tensor parallelism it
// issues the same collectives as forward did.
//
//   h = dtensor::activation_checkpoint([&](const at::Tensor& x) { return block->forward(x); }, h);
//
// Selective checkpointing saves the outputs of the ops a policy picks (e.g. the matmuls)
// and recomputes the rest:
//
//   auto opts = dtensor::ActivationCheckpointOptions().policy(dtensor::save_ops({"aten::mm"}));
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <dtensor/module_hooks.h>

namespace dtensor {

// What selective checkpointing does with an op's outputs (PyTorch's CheckpointPolicy).
// MustSave / PreferSave: saved in forward and reused by the recompute; MustRecompute /
// PreferRecompute: computed again. (The two strengths mean the same here: there is no
// compiler to overrule a preference.)
enum class CheckpointPolicy { MustSave, PreferSave, MustRecompute, PreferRecompute };

// Called for every op a checkpointed function runs, in forward and in the recompute (the
// same answer both times). Views, in-place ops and random ops are always recomputed and do
// not reach it.
using CheckpointPolicyFn = std::function<CheckpointPolicy(const c10::OperatorHandle& op)>;

// A policy that saves the outputs of the named ops ("aten::mm", "aten::addmm",
// "aten::_scaled_dot_product_flash_attention_for_cpu", ...; an overload may be named:
// "aten::add.Tensor") and recomputes everything else.
CheckpointPolicyFn save_ops(std::vector<std::string> names);

struct ActivationCheckpointOptions {
  // Replay the random state in the recompute: dtensor's (dtensor/random.h), the CPU
  // generator, and the default generator of every other device an input lives on.
  TORCH_ARG(bool, preserve_rng_state) = true;
  // Selective checkpointing; empty: recompute every op (full checkpointing).
  TORCH_ARG(CheckpointPolicyFn, policy) = nullptr;
};

using CheckpointFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs `fn(inputs)` keeping only `inputs` for backward; see the top of this file. Outputs
// that require grad get gradients through the recompute; `inputs` may be plain tensors or
// DTensors and need not require grad (parameters used inside still get theirs).
std::vector<at::Tensor> activation_checkpoint(const CheckpointFn& fn,
                                              const std::vector<at::Tensor>& inputs,
                                              const ActivationCheckpointOptions& options = {});
at::Tensor activation_checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                                 const at::Tensor& input,
                                 const ActivationCheckpointOptions& options = {});

// Activation checkpointing applied from outside the model (torchtitan's apply_ac): every call
// of `module` through dtensor::call runs its forward, and the hooks inside the checkpoint's
// order (tensor parallelism's), under activation_checkpoint with `options` ([Note: hook
// order] in dtensor/module_hooks.h). The module's parameter names do not change.
HookHandle checkpoint_module(torch::nn::Module& module, ActivationCheckpointOptions options = {});

// A module whose forward(x) is its inner module's forward(x), checkpointed: for stacks of
// blocks held in a Sequential or ModuleList (torch.distributed's checkpoint_wrapper). The
// inner module is registered as "module", so parameter names gain "module." (as
// checkpoint_wrapper's "_checkpoint_wrapped_module.").
class CheckpointWrapperImpl : public torch::nn::Module {
 public:
  // `inner`: any module whose forward takes and returns one tensor (a Sequential too).
  template <typename M>
  explicit CheckpointWrapperImpl(std::shared_ptr<M> inner, ActivationCheckpointOptions options = {})
      : options_(std::move(options)) {
    register_module("module", inner);
    forward_ = [inner](const at::Tensor& x) -> at::Tensor { return inner->forward(x); };
  }
  template <typename M>
  explicit CheckpointWrapperImpl(torch::nn::ModuleHolder<M> inner,
                                 ActivationCheckpointOptions options = {})
      : CheckpointWrapperImpl(inner.ptr(), std::move(options)) {}
  at::Tensor forward(const at::Tensor& x);
  const ActivationCheckpointOptions& options() const { return options_; }

 private:
  std::function<at::Tensor(const at::Tensor&)> forward_;
  ActivationCheckpointOptions options_;
};
TORCH_MODULE(CheckpointWrapper);

} // namespace dtensor
