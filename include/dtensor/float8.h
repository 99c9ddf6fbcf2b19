#pragma once

// Float8 training (docs/float8.md): torchao's Float8Linear in C++. A linear layer's three
// matrix products (output, grad_input, grad_weight) run on float8 operands through
// at::_scaled_mm (native on GPUs with float8 units, emulated by ATen on CPU), each operand
// scaled dynamically from its absolute maximum:
//
//   dtensor::convert_to_float8_training(*model,
//   Float8LinearOptions().recipe(Float8Recipe::Rowwise),
//                                       dtensor::float8_skip_output_and_unaligned);
//   at::Tensor y = dtensor::call(model->w1, x);   // float8 products, high-precision result
//
// The conversion registers an around-forward hook on each chosen torch::nn::Linear (the module
// seam, include/dtensor/module_hooks.h): the module and its parameters stay as they are
// (names, state dicts, fully_shard, init), only its call computes in float8. A Linear called
// as module->forward(x) bypasses the seam and computes in high precision.
//
// Recipes (torchao's Float8LinearConfig.from_recipe_name, numerics bit-equal to torchao's on
// CPU, test/float8/torchao_judge.py):
//   Tensorwise       one scale per tensor; input and weight e4m3, output gradient e5m2.
//   Rowwise          one scale per row of each operand along the reduced dimension, scales
//                    rounded down to powers of two, every operand e4m3.
//   RowwiseWithGwHp  as Rowwise for the output; the weight taken tensorwise for grad_input;
//                    grad_weight in high precision (torchao's rowwise_with_gw_hp).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <dtensor/module_hooks.h>

namespace dtensor {

namespace hook_order {
// Float8's products replace the Linear's forward: innermost, inside every layout hook.
constexpr int kFloat8 = 300;
} // namespace hook_order

enum class Float8Recipe { Tensorwise, Rowwise, RowwiseWithGwHp };

// "tensorwise", "rowwise", "rowwise_with_gw_hp" (torchao's names); anything else is refused,
// naming the valid ones.
Float8Recipe float8_recipe_from_name(const std::string& name);
const char* name_of(Float8Recipe recipe);

struct Float8LinearOptions {
  TORCH_ARG(Float8Recipe, recipe) = Float8Recipe::Tensorwise;
  // fully_shard gathers the converted weights as float8 bytes (half of bf16's), each cast with
  // one scale for the whole weight ([Note: float8 all-gather]). Tensorwise only; convert before
  // fully_shard.
  TORCH_ARG(bool, enable_fsdp_float8_all_gather) = false;
};

// y = x weight^T (+ bias), differentiable, with the recipe's float8 products. x [..., in],
// weight [out, in], bias [out]; floating dtypes; the result has x's dtype. Plain tensors,
// fully_shard's parameters (its unsharded values), and tensor parallelism's: a DTensor input
// and a Replicate / Shard(0) / Shard(1) weight (ColwiseParallel, RowwiseParallel, with
// fully_shard over them) compute what the unsharded layer computes, every scale the whole
// tensor's, from amaxes all-reduced over the mesh dimensions that shard them
// ([Note: float8 under tensor parallelism]); the result is laid out as the matmul's.
at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                         const Float8LinearOptions& options);

// Mixture-of-experts grouped products in float8, as torchao's fp8_grouped_mm
// (prototype.moe_training, torchtitan's Float8GroupedExpertsConverter): for the rows of each
// expert e in order (counts[e] of them), x[rows] w[e]^T; x [N, in], w [E, out, in], counts
// [E] (int64); differentiable in x and w. Every operand e4m3 with power-of-two scales, per
// expert: x per row and w[e] per output feature; in backward the output gradient per row
// and w[e] per input feature (grad_input), the output gradient and x per column within the
// expert's rows (grad_weight); the scales into every product (fast accumulation). Computed
// one expert at a time through at::_scaled_mm (on CPU ATen emulates it; the fused
// _scaled_grouped_mm of GPUs is not used yet). Plain tensors (a local region's). Rows past
// sum(counts) (expert parallelism's capacity padding) are left out and give zero rows.
at::Tensor float8_grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts);

// Which Linears convert_to_float8_training converts: (its qualified name, the module).
using Float8Filter = std::function<bool(const std::string& name, const torch::nn::LinearImpl&)>;

// torchtitan's filter: not the output projection ("output"), and only Linears whose in and
// out features are multiples of 16 (what float8 kernels need on GPUs).
bool float8_skip_output_and_unaligned(const std::string& name, const torch::nn::LinearImpl& linear);

// Registers the float8 hook on every torch::nn::Linear under `module` (itself included) that
// `filter` accepts (unset: all); returns the names of the converted ones, in module order.
// A Linear converted twice is refused by name.
std::vector<std::string> convert_to_float8_training(torch::nn::Module& module,
                                                    const Float8LinearOptions& options,
                                                    const Float8Filter& filter = nullptr);

// torchao's precompute_float8_dynamic_scale_for_fsdp: after the optimizer step, the float8
// all-gather scales of every converted weight under `module` from one MAX all-reduce of their
// shards' amaxes (one per data-parallel shard group: one for a model on one mesh), used by
// the next forward and backward. Without it each unit all-reduces its own amaxes when it first
// unshards in a step. Collective over the units' shard groups.
void precompute_float8_dynamic_scale_for_fsdp(torch::nn::Module& module);

} // namespace dtensor
