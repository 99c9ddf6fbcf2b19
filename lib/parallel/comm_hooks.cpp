// The built-in communication hooks and the division rule of gradient reductions.
#include <dtensor/comm_hooks.h>

#include <cmath>

#include <ATen/ATen.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "parallel/grad_reduce.h"

namespace dtensor {

namespace detail {

double predivide_factor(double size) {
  double factor = 1;
  while (std::fmod(size, factor) == 0 && size / factor > factor) {
    factor *= 2;
  }
  return factor;
}

DivideFactors gradient_divide_factors(int64_t dp_size, c10::ScalarType reduce_dtype, double factor,
                                      bool force_sum) {
  const bool overflow_risk = reduce_dtype != c10::kFloat && reduce_dtype != c10::kBFloat16;
  const auto size = static_cast<double>(dp_size);
  if (factor <= 0) {
    factor = size;
  }
  DivideFactors f;
  if (!overflow_risk && !force_sum) {
    if (factor == size) {
      if (dp_size > 1) {
        f.reduce_scatter_op = ReduceOp::Avg;
        f.all_reduce_op = ReduceOp::Avg;
      }
    } else {
      f.premul = 1.0 / factor;
    }
    return f;
  }
  f.pre = overflow_risk ? predivide_factor(factor) : 1.0;
  f.post = factor / f.pre;
  return f;
}

CommHookState resolved_hook_state(CommHookState state, const Group& group) {
  if (!state.group.defined()) {
    state.group = group;
  }
  const auto size = static_cast<double>(state.group.size());
  if (state.gradient_predivide_factor <= 0) {
    state.gradient_predivide_factor = predivide_factor(size);
  }
  if (state.gradient_postdivide_factor <= 0) {
    state.gradient_postdivide_factor = size / state.gradient_predivide_factor;
  }
  return state;
}

} // namespace detail

namespace {

void divide_if_needed(at::Tensor& t, double factor) {
  if (factor != 1) {
    t.div_(factor);
  }
}

void default_all_reduce(const CommHookState& state, at::Tensor& bucket) {
  divide_if_needed(bucket, state.gradient_predivide_factor);
  dtensor::all_reduce_(bucket, ReduceOp::Sum, state.group, detail::known_sizes());
  divide_if_needed(bucket, state.gradient_postdivide_factor);
}

void default_reduce_scatter(const CommHookState& state, at::Tensor& grad, at::Tensor& output) {
  divide_if_needed(grad, state.gradient_predivide_factor);
  dtensor::reduce_scatter_tensor_into(output, grad, ReduceOp::Sum, state.group,
                                      detail::known_sizes());
  divide_if_needed(output, state.gradient_postdivide_factor);
}

// [Note: compression hooks] The gradient is cast to the low precision, reduced there by the
// default hook, and the result cast back to the dtype the gradient came in: what FSDP1's
// fp16/bf16_compress_hook do, and what mp_policy.reduce_dtype does without a hook.
CommHook compress_hook(c10::ScalarType low, std::string name) {
  CommHook hook;
  hook.name = std::move(name);
  hook.all_reduce = [low](const CommHookState& state, at::Tensor& bucket) {
    const c10::ScalarType orig = bucket.scalar_type();
    at::Tensor compressed = bucket.to(low);
    default_all_reduce(state, compressed);
    bucket = compressed.to(orig);
  };
  hook.reduce_scatter = [low](const CommHookState& state, at::Tensor& grad, at::Tensor& output) {
    const c10::ScalarType orig = output.scalar_type();
    at::Tensor in = grad.to(low);
    at::Tensor out = at::empty(output.sizes(), output.options().dtype(low));
    default_reduce_scatter(state, in, out);
    output = out.to(orig);
  };
  return hook;
}

} // namespace

CommHook default_comm_hook() {
  CommHook hook;
  hook.name = "default";
  hook.all_reduce = default_all_reduce;
  hook.reduce_scatter = default_reduce_scatter;
  return hook;
}

CommHook fp16_compress_hook() {
  return compress_hook(c10::kHalf, "fp16_compress");
}

CommHook bf16_compress_hook() {
  return compress_hook(c10::kBFloat16, "bf16_compress");
}

} // namespace dtensor
