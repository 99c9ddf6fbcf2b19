#pragma once

// Drawing the local box of a layout-independent random tensor ([Note: layout-independent
// random numbers] in lib/tensor/random/random_ops.cpp).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tensor/random/philox.h"

namespace dtensor::detail {

// One random op's distribution: values are a function of the element's Philox words alone.
struct Distribution {
  enum Kind { kUniform, kNormal, kBernoulli, kRandom, kExponential, kLogNormal, kCauchy, kGeometric };
  Kind kind = kUniform;
  double a = 0.0; // uniform: from; normal / log_normal: mean; bernoulli / geometric: p;
                  // exponential: lambda; cauchy: median
  double b = 1.0; // uniform: to; normal / log_normal: std; cauchy: sigma
  int64_t from = 0;  // random_: [from, from + range)
  uint64_t range = 0; // random_: 0 means 2^63 (every non-negative int64)
  std::string name() const;
};

// The key and the op offset of one draw.
struct Draw {
  uint64_t seed = 0;
  uint64_t offset = 0;
};

// Where a local tensor lies in its global tensor: a box (DTensor shards are boxes).
struct Box {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offset; // per dim, where the local tensor starts
};

// Fills `out` (of the box's local shape, any strides) with the distribution's values for
// its elements. `prob`, for bernoulli with a tensor p: the probabilities, broadcastable to
// `out`. Works in chunks, so the transient memory is bounded whatever out's size.
void fill_box(at::Tensor& out, const Box& box, const Draw& draw, const Distribution& dist,
              const std::optional<at::Tensor>& prob = std::nullopt);

// The values of `dist` for elements `index` of draw `draw`: float64 (int64 for kRandom;
// for kBernoulli the uniform that is compared with p). On CPU a scalar loop over
// at::philox_engine; elsewhere Philox and the distribution as tensor ops ([Note: one
// function per element]).
at::Tensor draw_values(const at::Tensor& index, const Draw& draw, const Distribution& dist);

// The tensor-op form on any device (the GPU path, run on CPU by the tests).
at::Tensor draw_values_by_ops(const at::Tensor& index, const Draw& draw, const Distribution& dist);

} // namespace dtensor::detail
