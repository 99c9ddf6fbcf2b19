#pragma once

// Post-accumulate-grad hooks for C++ (PyTorch's Tensor.register_post_accumulate_grad_hook,
// which LibTorch has only for Python): `hook(param)` runs once `param.grad()` holds this
// backward's gradient. For optimizer-in-backward (step and free each gradient as soon as it
// is final) and gradient processing.
//  - plain parameters: after autograd accumulates the gradient (LibTorch calls it);
//  - fully_shard parameters: after the reduce-scatter (HSDP: and the all-reduce) wrote the
//    reduced Shard gradient into .grad, once per parameter and synchronised backward (FSDP2);
//    not in a backward without gradient sync or with set_requires_all_reduce(false), which
//    leave .grad alone;
//  - replicate parameters: after the local accumulation, before the all-reduce (as DDP).
// Hooks run in registration order; a parameter may have several.
#include <functional>

#include <ATen/core/Tensor.h>

namespace dtensor {

using PostAccumulateGradHook = std::function<void(const at::Tensor& param)>;

// `param` must be a leaf that requires grad.
void register_post_accumulate_grad_hook(const at::Tensor& param, PostAccumulateGradHook hook);

} // namespace dtensor
