#pragma once

// How data-parallel gradient reductions divide, shared by fully_shard, replicate and the
// built-in communication hooks. See docs/comm_hooks.md "Division".
#include <cstdint>
#include <vector>

#include <c10/core/ScalarType.h>

#include <dtensor/collectives.h>
#include <dtensor/comm_hooks.h>

namespace dtensor::detail {

// [Note: gradient division] FSDP2's rule (_get_gradient_divide_factors in PyTorch's
// torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). fp32 / bf16 reductions carry
// the division in the collective: AVG when the factor is the data-parallel size (SUM for
// size 1), otherwise a pre-multiplication by 1 / factor (NCCL's PreMulSum) with SUM.
// fp16 (overflow risk) and forced-SUM reductions use SUM collectives with a division
// before (fp16: the power of two predivide_factor gives) and after.
struct DivideFactors {
  double premul = 1; // multiply the reduce-scatter input by this
  double pre = 1;    // divide the input by this
  double post = 1;   // divide the result by this
  ReduceOp reduce_scatter_op = ReduceOp::Sum;
  ReduceOp all_reduce_op = ReduceOp::Sum;
};
DivideFactors gradient_divide_factors(int64_t dp_size, c10::ScalarType reduce_dtype, double factor,
                                      bool force_sum);

// FSDP1's pre-division factor for `size` ranks: powers of two while they divide the size
// and stay below its square root.
double predivide_factor(double size);

// The state a hook is called with: `state` with its undefined parts filled in for `group`.
CommHookState resolved_hook_state(CommHookState state, const Group& group);

// Whether `param`'s gradient is reduced over every one of the global `ranks` by a data-parallel
// wrapper: a DTensor parameter (fully_shard, tensor parallelism) whose mesh holds them all,
// or a plain one replicate() manages over a mesh that does.
bool gradient_reduced_over(const at::Tensor& param, const std::vector<int>& ranks);

} // namespace dtensor::detail
