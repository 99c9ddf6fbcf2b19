#pragma once

// Float8 scales and casts as torchao computes them ([Note: float8 scales as torchao computes
// them] in float8_linear.cpp): shared by the float8 linear and fully_shard's float8 all-gather.
#include <ATen/core/Tensor.h>

namespace dtensor::detail {

// The largest finite value of e4m3fn (448) or e5m2 (57344).
double float8_max(c10::ScalarType dtype);
// max(dtype) x reciprocal(clamp(amax, 1e-12)) in fp64, to fp32; optionally rounded down to a
// power of two.
at::Tensor float8_amax_to_scale(const at::Tensor& amax, c10::ScalarType dtype, bool pow2);
// hp x scale in fp32, saturated to +-max(dtype), converted to dtype.
at::Tensor float8_cast(const at::Tensor& hp, const at::Tensor& scale, c10::ScalarType dtype);

} // namespace dtensor::detail
