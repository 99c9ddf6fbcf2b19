// Drawing the local box of a layout-independent random tensor (see sample.h).
#include "tensor/random/sample.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/PhiloxRNGEngine.h>

#include "internal/check.h"
#include "mesh/dispatch_keys.h"
#include "tensor/random/rng_state.h"

namespace dtensor::detail {

namespace {

// [Note: one function per element]
// Layout independence needs every element's value to be one fixed function of its counter,
// wherever the element sits in a chunk. ATen's CPU kernels do not promise that for
// transcendental functions: a chunk's body runs vectorised (SLEEF) and its tail scalar
// (libm), and the two may differ in the last bit, so the same element could get a different
// value on a different layout. On CPU each element is therefore computed by the scalar code
// below, Philox words included. GPU elementwise kernels apply the same device function to
// every element, so there the tensor-op form is position-independent as it stands. The two
// forms agree exactly on the words and on uniform / bernoulli / random_ values, and to the
// last bits of the libm functions on the others (test_random: "the GPU path on CPU").

constexpr int64_t kChunk = int64_t{1} << 16; // elements per chunk: bounds transient memory
constexpr double kTwoPi = 2.0 * M_PI;
const double kTwoToMinus53 = std::ldexp(1.0, -53);

// A uniform double in [0, 1) from two words: 27 + 26 = 53 random bits.
double uniform53(uint32_t hi, uint32_t lo) {
  const auto k = static_cast<int64_t>(((uint64_t{hi} >> 5) << 26) + (uint64_t{lo} >> 6));
  return static_cast<double>(k) * kTwoToMinus53;
}

double standard_normal(const uint32_t w[4]) {
  const double radius = std::sqrt(std::log(1.0 - uniform53(w[0], w[1])) * -2.0);
  return std::cos(uniform53(w[2], w[3]) * kTwoPi) * radius;
}

double value_of(const uint32_t w[4], const Distribution& d) {
  switch (d.kind) {
  case Distribution::kUniform:
    return uniform53(w[0], w[1]) * (d.b - d.a) + d.a;
  case Distribution::kNormal:
    return standard_normal(w) * d.b + d.a;
  case Distribution::kBernoulli:
    return uniform53(w[0], w[1]);
  case Distribution::kExponential:
    return std::log(1.0 - uniform53(w[0], w[1])) * (-1.0 / d.a);
  case Distribution::kLogNormal:
    return std::exp(standard_normal(w) * d.b + d.a);
  case Distribution::kCauchy:
    return std::tan((uniform53(w[0], w[1]) - 0.5) * M_PI) * d.b + d.a;
  case Distribution::kGeometric:
    return std::max(1.0, std::ceil(std::log(1.0 - uniform53(w[0], w[1])) / std::log1p(-d.a)));
  case Distribution::kRandom:
    break;
  }
  return 0.0;
}

// 63 random bits reduced into [from, from + range) (range 0: all of them).
int64_t integer_of(const uint32_t w[4], const Distribution& d) {
  auto bits = static_cast<int64_t>((uint64_t{w[0] & 0x7FFFFFFFU} << 32) | w[1]);
  if (d.range != 0) {
    bits %= static_cast<int64_t>(d.range);
  }
  return bits + d.from;
}

at::Tensor draw_on_cpu(const at::Tensor& index, const Draw& draw, const Distribution& dist) {
  at::Tensor idx = index.contiguous();
  const bool integers = dist.kind == Distribution::kRandom;
  at::Tensor out = at::empty(idx.sizes(), idx.options().dtype(integers ? at::kLong : at::kDouble));
  const int64_t* in = idx.const_data_ptr<int64_t>();
  int64_t* ints = integers ? out.mutable_data_ptr<int64_t>() : nullptr;
  double* reals = integers ? nullptr : out.mutable_data_ptr<double>();
  at::parallel_for(0, idx.numel(), 4096, [&](int64_t begin, int64_t end) {
    uint32_t w[4];
    for (int64_t k = begin; k < end; ++k) {
      at::Philox4_32 engine(draw.seed, static_cast<uint64_t>(in[k]), draw.offset);
      for (uint32_t& word : w) {
        word = engine();
      }
      if (integers) {
        ints[k] = integer_of(w, dist);
      } else {
        reals[k] = value_of(w, dist);
      }
    }
  });
  return out;
}

// The tensor-op forms of the scalar functions above, operation for operation.
at::Tensor uniform53_t(const at::Tensor& hi, const at::Tensor& lo) {
  at::Tensor k =
      at::bitwise_right_shift(hi, 5).bitwise_left_shift_(26).add_(at::bitwise_right_shift(lo, 6));
  return k.to(at::kDouble).mul_(kTwoToMinus53);
}

at::Tensor standard_normal_t(const PhiloxWords& w) {
  at::Tensor radius = at::rsub(uniform53_t(w[0], w[1]), 1.0).log_().mul_(-2.0).sqrt_();
  return uniform53_t(w[2], w[3]).mul_(kTwoPi).cos_().mul_(radius);
}

// Per local element: its row-major index in the global tensor.
at::Tensor global_index(const Box& box, const std::vector<int64_t>& local_shape, int64_t begin,
                        int64_t end, const at::TensorOptions& options) {
  at::Tensor j = at::arange(begin, end, options.dtype(at::kLong));
  at::Tensor g = at::zeros_like(j);
  int64_t local_stride = 1;
  int64_t global_stride = 1;
  for (int64_t d = static_cast<int64_t>(local_shape.size()) - 1; d >= 0; --d) {
    at::Tensor coord = at::floor_divide(j, local_stride).remainder_(local_shape[d]);
    g.add_(coord.add_(box.offset[d]).mul_(global_stride));
    local_stride *= local_shape[d];
    global_stride *= box.global_shape[d];
  }
  return g;
}

// [Note: filling in place on CPU]
// A contiguous float / double CPU tensor is filled element by element where it lies, with
// each element's global index advanced like an odometer: no index, value or cast buffers,
// so initializing a model's shards needs no memory beyond the shards themselves
// (docs/meta_init.md). Each value is the same function of its counter as in the chunked
// path (value_of, then the same cast and the same clamp below `to`), so the two paths give
// the same bits and a layout may use either.
template <class T>
void fill_in_place(T* data, int64_t n, const Box& box, const std::vector<int64_t>& local,
                   const Draw& draw, const Distribution& dist) {
  const auto nd = static_cast<int64_t>(local.size());
  std::vector<int64_t> global_stride(local.size(), 1);
  for (int64_t d = nd - 2; d >= 0; --d) {
    global_stride[d] = global_stride[d + 1] * box.global_shape[d + 1];
  }
  const bool clamp = dist.kind == Distribution::kUniform && dist.b > dist.a;
  const T upper = clamp ? std::nextafter(static_cast<T>(dist.b), static_cast<T>(dist.a)) : T(0);
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> coord(local.size(), 0);
    int64_t global = 0;
    for (int64_t d = nd - 1, rest = begin; d >= 0; --d) {
      coord[d] = rest % local[d];
      rest /= local[d];
      global += (coord[d] + box.offset[d]) * global_stride[d];
    }
    uint32_t w[4];
    for (int64_t k = begin; k < end; ++k) {
      at::Philox4_32 engine(draw.seed, static_cast<uint64_t>(global), draw.offset);
      for (uint32_t& word : w) {
        word = engine();
      }
      const double v = value_of(w, dist);
      T c = dist.kind == Distribution::kBernoulli ? T(v < dist.a ? 1 : 0) : static_cast<T>(v);
      data[k] = clamp ? std::min(c, upper) : c;
      for (int64_t d = nd - 1; d >= 0; --d) { // the next local element's global index
        global += global_stride[d];
        if (++coord[d] < local[d] || d == 0) {
          break;
        }
        global -= local[d] * global_stride[d];
        coord[d] = 0;
      }
    }
  });
}

// Whether fill_in_place serves `out`.
bool fills_in_place(const at::Tensor& out, const Distribution& dist, bool has_prob) {
  return out.device().is_cpu() && out.is_contiguous() && !has_prob &&
         dist.kind != Distribution::kRandom &&
         (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble);
}

// The largest value of `dtype` below `to` (uniform_ is half-open even after rounding).
at::Tensor below(double to, double from, at::ScalarType dtype, const at::Device& device) {
  at::TensorOptions o = at::TensorOptions().dtype(dtype).device(device);
  return at::nextafter(at::scalar_tensor(to, o), at::scalar_tensor(from, o));
}

} // namespace

std::string Distribution::name() const {
  static const char* names[] = {"uniform_",     "normal_",     "bernoulli", "random_",
                                "exponential_", "log_normal_", "cauchy_",   "geometric_"};
  return names[kind];
}

at::Tensor draw_values_by_ops(const at::Tensor& index, const Draw& draw, const Distribution& d) {
  const PhiloxWords w = philox_words_by_ops(index, draw.seed, draw.offset);
  switch (d.kind) {
  case Distribution::kUniform:
    return uniform53_t(w[0], w[1]).mul_(d.b - d.a).add_(d.a);
  case Distribution::kNormal:
    return standard_normal_t(w).mul_(d.b).add_(d.a);
  case Distribution::kBernoulli:
    return uniform53_t(w[0], w[1]);
  case Distribution::kRandom: {
    at::Tensor bits = at::bitwise_and(w[0], 0x7FFFFFFFLL).bitwise_left_shift_(32).bitwise_or_(w[1]);
    if (d.range != 0) {
      bits.remainder_(static_cast<int64_t>(d.range));
    }
    return bits.add_(d.from);
  }
  case Distribution::kExponential:
    return at::rsub(uniform53_t(w[0], w[1]), 1.0).log_().mul_(-1.0 / d.a);
  case Distribution::kLogNormal:
    return standard_normal_t(w).mul_(d.b).add_(d.a).exp_();
  case Distribution::kCauchy:
    return uniform53_t(w[0], w[1]).sub_(0.5).mul_(M_PI).tan_().mul_(d.b).add_(d.a);
  case Distribution::kGeometric:
    return at::rsub(uniform53_t(w[0], w[1]), 1.0)
        .log_()
        .div_(std::log1p(-d.a))
        .ceil_()
        .clamp_min_(1.0);
  }
  DTENSOR_FAIL("random: unknown distribution {}", static_cast<int>(d.kind));
}

at::Tensor draw_values(const at::Tensor& index, const Draw& draw, const Distribution& dist) {
  DTENSOR_CHECK(index.scalar_type() == at::kLong, "random {}: index must be int64, got {}",
                dist.name(), c10::toString(index.scalar_type()));
  return index.device().is_cpu() ? draw_on_cpu(index, draw, dist)
                                 : draw_values_by_ops(index, draw, dist);
}

void fill_box(at::Tensor& out, const Box& given, const Draw& draw, const Distribution& dist,
              const std::optional<at::Tensor>& prob) {
  const Box box = in_global_batch(given);
  const std::vector<int64_t> local_shape = out.sizes().vec();
  DTENSOR_CHECK(local_shape.size() == box.global_shape.size(),
                "random {}: local shape {} and global shape {} differ in rank", dist.name(),
                local_shape, box.global_shape);
  const int64_t n = out.numel();
  // Meta, or a simulated world's device ([Note: the simulated device]): no values to draw.
  // (Drawing by ops there costs nothing per element but ~100 ops per 64k-element chunk: 15 s
  // of a simulated Llama 3 70B rank's initialisation on 1x8x8.)
  if (n == 0 || out.is_meta() || out.device().type() == kSimulatedDevice) {
    return;
  }
  if (fills_in_place(out, dist, prob.has_value())) {
    if (out.scalar_type() == at::kFloat) {
      fill_in_place(out.mutable_data_ptr<float>(), n, box, local_shape, draw, dist);
    } else {
      fill_in_place(out.mutable_data_ptr<double>(), n, box, local_shape, draw, dist);
    }
    return;
  }
  at::Tensor flat = out.is_contiguous() ? out.view({-1}) : at::empty({n}, out.options());
  at::Tensor p_flat;
  if (prob) {
    p_flat = prob->to(out.device()).expand(local_shape).reshape({-1});
  }
  std::optional<at::Tensor> upper;
  if (dist.kind == Distribution::kUniform && dist.b > dist.a &&
      at::isFloatingType(out.scalar_type())) {
    upper = below(dist.b, dist.a, out.scalar_type(), out.device());
  }
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t end = std::min(n, begin + kChunk);
    at::Tensor values =
        draw_values(global_index(box, local_shape, begin, end, out.options()), draw, dist);
    if (dist.kind == Distribution::kBernoulli) {
      values = prob ? values.lt(p_flat.slice(0, begin, end).to(at::kDouble)) : values.lt(dist.a);
    }
    at::Tensor cast = values.to(out.scalar_type());
    if (upper) {
      cast = at::minimum(cast, *upper);
    }
    flat.slice(0, begin, end).copy_(cast);
  }
  if (!out.is_contiguous()) {
    out.copy_(flat.view(local_shape));
  }
}

} // namespace dtensor::detail
