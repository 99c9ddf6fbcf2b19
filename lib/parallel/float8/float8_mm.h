#pragma once

// A float8 linear's products on local tensors (torchao's Float8Linear numerics, float8_mm.cpp),
// for the float8 linear on plain tensors and fully_shard's unsharded weights
// (float8_linear.cpp) and under tensor parallelism (float8_tp.cpp).
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <dtensor/float8.h>
#include <dtensor/process_group.h>

namespace dtensor::detail {

// The groups over which the local operands are shards of the whole ([Note: float8 under tensor
// parallelism] in float8_tp.cpp): x viewed as [M, K] (rows: its leading dimensions, cols: in
// features), the weight [N, K] (rows: out features, cols: in features). Empty: unsharded.
struct Float8Sharding : torch::CustomClassHolder {
  std::vector<Group> x_rows, x_cols, w_rows, w_cols;
};

// y = x weight^T, differentiable, with the recipe's float8 products. `weight_scale`: the scale
// fully_shard gathered the weight with (undefined: none). Every amax is all-reduced (MAX) over
// the groups of `sharding` (null: none) where its operand is sharded along what it reduces,
// batched into one all-reduce per group in forward and one in backward, so that each scale is
// the whole tensor's.
at::Tensor float8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                     Float8Recipe recipe, const c10::intrusive_ptr<Float8Sharding>& sharding);
// The same with `weight` a fully_shard parameter that its unit keeps as the float8 bits it
// gathered with `weight_scale` (gathered_unsharded): the products read those bits, and the
// gradient goes to the parameter.
at::Tensor float8_mm_kept(const at::Tensor& x, const at::Tensor& weight,
                          const at::Tensor& weight_scale, Float8Recipe recipe);

} // namespace dtensor::detail

namespace dtensor::detail {

// float8_grouped_mm on plain tensors (checked by the caller).
at::Tensor float8_grouped_mm_local(const at::Tensor& x, const at::Tensor& w,
                                   const at::Tensor& counts);

// Whether `weight` is a parallelized Linear's (tensor parallelism; under fully_shard too).
bool float8_tp_weight(const at::Tensor& weight);
// float8_linear with a DTensor input or a tensor-parallel weight: the products on the local
// shards with every scale the whole tensor's (float8_tp.cpp).
at::Tensor float8_linear_tp(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            Float8Recipe recipe);

} // namespace dtensor::detail
