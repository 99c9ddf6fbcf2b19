#pragma once

// Communication hooks (FSDP1's register_comm_hook, in per-parameter terms) and
// FSDP2's custom collectives for fully_shard. See docs/comm_hooks.md.
//
//   auto root = dtensor::fully_shard(*model);
//   root.register_comm_hook(dtensor::CommHookState(), dtensor::bf16_compress_hook());
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <dtensor/collectives.h>
#include <dtensor/process_group.h>

namespace dtensor {

// What a communication hook is called with (FSDP1's DefaultState / LowPrecisionState).
// Data of your own goes into the hook's closure. Whatever is left undefined here is filled
// in for each call: `group` with the unit's shard group (fully_shard) or the mesh's group
// (replicate); the divide factors from the group's size, FSDP1's split: the largest power
// of two p with p * p < size (stopping at the first p not dividing the size) before the
// reduction, size / p after it, so that low-precision sums neither overflow nor underflow.
struct CommHookState {
  Group group;
  double gradient_predivide_factor = 0;
  double gradient_postdivide_factor = 0;
};

// fully_shard: `grad` is the unit's flat gradient, unsharded (every group rank's padded
// shard in group-rank order) in the unit's reduce dtype; the hook leaves this rank's reduced
// shard in `output` (numel grad.numel() / group size). It may replace either tensor (with
// another dtype, say); `output` must keep its numel. It replaces the reduce-scatter and the
// division; the cast to the gradients' dtype follows.
using ReduceScatterHook =
    std::function<void(const CommHookState& state, at::Tensor& grad, at::Tensor& output)>;
// replicate: `bucket` is a flat bucket of gradients; the hook leaves their reduction in it
// (or replaces it by a tensor of the same numel). It replaces the all-reduce and division.
using AllReduceHook = std::function<void(const CommHookState& state, at::Tensor& bucket)>;

struct CommHook {
  std::string name;                 // for messages
  ReduceScatterHook reduce_scatter; // used by fully_shard units
  AllReduceHook all_reduce;         // used by replicate
};

// The built-in hooks (torch.distributed.algorithms._comm_hooks.default_hooks):
// the default is pre-divide, SUM, post-divide (the mean over the group); the compression
// hooks cast the gradient to fp16 / bf16, run the default, and cast the result back to the
// gradient's dtype. Their collectives go through dtensor's (CommDebugMode counts them).
CommHook default_comm_hook();
CommHook fp16_compress_hook();
CommHook bf16_compress_hook();

// FSDP2's custom collectives (set_custom_all_gather / set_custom_reduce_scatter): `allocate`
// (optional; default at::empty) makes the communication buffers, the call does the
// collective. Issue it through dtensor's collectives to keep CommDebugMode's counts.
using CommAllocator =
    std::function<at::Tensor(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device)>;
struct CustomAllGather {
  CommAllocator allocate;
  // `output` receives every group rank's `input`, in group-rank order.
  std::function<void(at::Tensor& output, const at::Tensor& input, const Group& group)> call;
};
struct CustomReduceScatter {
  CommAllocator allocate;
  // `input` is reduced with `op` over `group`; group rank r keeps slice r in `output`.
  std::function<void(at::Tensor& output, const at::Tensor& input, const Group& group, ReduceOp op)>
      call;
};

} // namespace dtensor
