// Random ops on DTensors: their sharding rules and the local kernels that draw each rank's
// piece of a layout-independent full tensor; the plain-tensor reference (dtensor/random.h).
#include <cmath>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <dtensor/dtensor.h>
#include <dtensor/random.h>

#include "internal/check.h"
#include "tensor/ops/registry.h"
#include "tensor/random/rng_state.h"
#include "tensor/random/sample.h"

namespace dtensor::detail {

namespace {

// [Note: layout-independent random numbers]
// A random op fills a global tensor: element i (row-major index over the global shape) gets
// the value of a fixed function of Philox4x32-10(key = seed, counter = (offset, i)), where
// (seed, offset) is the op's draw (rng_state.cpp) and is the same on every rank. Proof that
// the full tensor does not depend on the layout: a rank holding a shard computes exactly the
// elements of its box (local offset + local index, mapped to the global row-major index),
// with the same function of the same counters; the full tensor assembled from any set of
// boxes covering it is therefore elementwise that function, whatever the mesh, world size,
// placements or unevenness. Replicas compute the same box, so they are equal; different
// elements have different counters, so shards are not copies of each other. A plain tensor
// (dtensor::normal_ and friends) is the one-box case. Each op consumes one offset, so the
// sequence of draws is the same on every layout too. The words are produced by at::philox_engine
// on CPU and by int64 tensor ops elsewhere (philox.cpp); the distributions are tensor ops on
// both (sample.cpp).

Box box_of(const DTensorSpec& spec) { return Box{spec.shape, spec.local_offset()}; }

std::optional<at::Generator> generator_arg(const c10::IValue& v) {
  if (v.isGenerator()) {
    return v.toGenerator();
  }
  return std::nullopt;
}

// The largest value random_ without `to` draws for `dtype` (floating types: the integers
// their mantissa holds exactly, as ATen).
uint64_t random_max(at::ScalarType dtype) {
  switch (dtype) {
  case at::kDouble: return uint64_t{1} << 53;
  case at::kFloat: return uint64_t{1} << 24;
  case at::kHalf: return uint64_t{1} << 11;
  case at::kBFloat16: return uint64_t{1} << 8;
  case at::kBool: return 1;
  case at::kByte: return 255;
  case at::kChar: return 127;
  case at::kShort: return 32767;
  case at::kInt: return 2147483647;
  default: return (uint64_t{1} << 63) - 1;
  }
}

// random_(self), random_.to(self, to), random_.from(self, from, to): integers in [from, to).
Distribution random_range(const OpInfo& info, at::ScalarType dtype) {
  const std::string name(info.name);
  Distribution d;
  d.kind = Distribution::kRandom;
  const uint64_t max = random_max(dtype);
  int64_t from = 0;
  uint64_t span = max + 1; // values in [from, from + span)
  if (name == "aten::random_.to") {
    const int64_t to = info.arg(1).toInt();
    DTENSOR_CHECK(to > 0, "{}: expects from < to, got from=0 to={}", info.name, to);
    span = static_cast<uint64_t>(to);
  } else if (name == "aten::random_.from") {
    from = info.arg(1).toInt();
    const c10::IValue& to = info.arg(2);
    if (to.isNone()) {
      DTENSOR_CHECK(from >= 0 && static_cast<uint64_t>(from) <= max,
                    "{}: from={} is outside [0, {}] for {}", info.name, from, max,
                    c10::toString(dtype));
      span = max - static_cast<uint64_t>(from) + 1;
    } else {
      DTENSOR_CHECK(from < to.toInt(), "{}: expects from < to, got from={} to={}", info.name,
                    from, to.toInt());
      span = static_cast<uint64_t>(to.toInt() - from);
    }
  } else {
    DTENSOR_CHECK(name == "aten::random_", "{}: not a random op dtensor draws", info.name);
  }
  d.from = from;
  d.range = span >= (uint64_t{1} << 63) ? 0 : span; // 0: all 63 bits
  return d;
}

// The distribution of an in-place random op (self first, generator last).
Distribution distribution_of(const OpInfo& info, at::ScalarType dtype) {
  const std::string name(info.name);
  auto num = [&](size_t i) { return info.arg(i).toDouble(); };
  Distribution d;
  if (name == "aten::uniform_") {
    d = {Distribution::kUniform, num(1), num(2)};
    DTENSOR_CHECK(d.a <= d.b, "{}: expects from <= to, got from={} to={}", info.name, d.a, d.b);
  } else if (name == "aten::normal_") {
    d = {Distribution::kNormal, num(1), num(2)};
    DTENSOR_CHECK(d.b >= 0.0, "{}: expects std >= 0.0, got std={}", info.name, d.b);
  } else if (name == "aten::bernoulli_.float" || name == "aten::bernoulli.p") {
    d = {Distribution::kBernoulli, num(1)};
    DTENSOR_CHECK(d.a >= 0.0 && d.a <= 1.0, "{}: expects 0 <= p <= 1, got p={}", info.name, d.a);
  } else if (name == "aten::bernoulli_.Tensor" || name == "aten::bernoulli") {
    d.kind = Distribution::kBernoulli;
  } else if (name == "aten::exponential_") {
    d = {Distribution::kExponential, num(1)};
    DTENSOR_CHECK(d.a > 0.0, "{}: expects lambda > 0.0, got lambda={}", info.name, d.a);
  } else if (name == "aten::log_normal_") {
    d = {Distribution::kLogNormal, num(1), num(2)};
    DTENSOR_CHECK(d.b > 0.0, "{}: expects std > 0.0, got std={}", info.name, d.b);
  } else if (name == "aten::cauchy_") {
    d = {Distribution::kCauchy, num(1), num(2)};
  } else if (name == "aten::geometric_") {
    d = {Distribution::kGeometric, num(1)};
    DTENSOR_CHECK(d.a > 0.0 && d.a < 1.0, "{}: expects 0 < p < 1, got p={}", info.name, d.a);
  } else {
    d = random_range(info, dtype);
  }
  return d;
}

// The spec of output `r` of a functional random op (the input's shape, the rule's placements).
DTensorSpec output_spec_of(const OpInfo& info, const OpSharding& sharding, size_t r) {
  DTensorSpec s = *info.specs[0];
  s.placements = sharding.outputs[r];
  return s;
}

// uniform_, normal_, bernoulli_, random_, exponential_, log_normal_, cauchy_, geometric_:
// self (local) is filled with its box of the op's global draw.
void fill_in_place(const OpInfo& info, const OpSharding&, torch::jit::Stack* stack) {
  const size_t n = info.num_args();
  const size_t base = stack->size() - n;
  at::Tensor self = (*stack)[base].toTensor();
  const Distribution d = distribution_of(info, self.scalar_type());
  std::optional<at::Tensor> prob;
  if (info.name == "aten::bernoulli_.Tensor") {
    prob = (*stack)[base + 1].toTensor();
  }
  const Draw draw = next_draw(generator_arg((*stack)[base + n - 1]), info.name.data());
  fill_box(self, box_of(*info.specs[0]), draw, d, prob);
  stack->resize(base);
  stack->emplace_back(self);
}

// bernoulli(probs) and bernoulli.p(self, p): a new tensor shaped like self.
void bernoulli_out_of_place(const OpInfo& info, const OpSharding& sharding,
                            torch::jit::Stack* stack) {
  const size_t n = info.num_args();
  const size_t base = stack->size() - n;
  at::Tensor self = (*stack)[base].toTensor();
  const Distribution d = distribution_of(info, self.scalar_type());
  std::optional<at::Tensor> prob;
  if (info.name == "aten::bernoulli") {
    prob = self;
  }
  at::Tensor out = at::empty_like(self, at::MemoryFormat::Contiguous);
  const Draw draw = next_draw(generator_arg((*stack)[base + n - 1]), info.name.data());
  fill_box(out, box_of(output_spec_of(info, sharding, 0)), draw, d, prob);
  stack->resize(base);
  stack->emplace_back(out);
}

// native_dropout(input, p, train): (input * mask / (1 - p), mask), the mask a Bernoulli(1 - p)
// draw over the global tensor (ATen's kernel, with dtensor's draw); not training: (a copy,
// all true), no draw.
void dropout_local(const OpInfo& info, const OpSharding& sharding, torch::jit::Stack* stack) {
  const size_t base = stack->size() - 3;
  at::Tensor input = (*stack)[base].toTensor();
  const double p = (*stack)[base + 1].toDouble();
  const c10::IValue train = (*stack)[base + 2];
  DTENSOR_CHECK(p >= 0.0 && p <= 1.0, "{}: dropout probability has to be between 0 and 1, got {}",
                info.name, p);
  at::Tensor out;
  at::Tensor mask;
  if (!train.isNone() && !train.toBool()) {
    out = input.clone();
    mask = at::ones_like(input, input.options().dtype(at::kBool));
  } else {
    mask = at::empty(input.sizes(), input.options().dtype(at::kBool));
    const Draw draw = next_draw(std::nullopt, info.name.data());
    fill_box(mask, box_of(output_spec_of(info, sharding, 1)), draw,
             Distribution{Distribution::kBernoulli, 1.0 - p});
    const double scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
    out = input.mul(mask).mul_(scale);
  }
  stack->resize(base);
  stack->emplace_back(out);
  stack->emplace_back(mask);
}

// In place: self keeps its placements, a Partial cannot be filled (its pieces are summands);
// bernoulli_'s tensor p is brought to self's layout.
OpSharding random_in_place(const OpInfo& info) {
  const DTensorSpec& self = *info.specs[0];
  for (const auto& p : self.placements) {
    if (p.is_partial()) {
      fail_unsupported(info, "a Partial DTensor cannot be filled with random values; "
                             "redistribute it to Replicate first");
    }
  }
  (void)distribution_of(info, self.dtype); // refuses bad parameters before anything runs
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.outputs.push_back(self.placements);
  s.output_shapes.push_back(self.shape);
  if (info.num_args() > 1 && info.specs[1]) {
    if (info.specs[1]->shape != self.shape) {
      fail_unsupported(info, fmt::format("the probabilities must have self's shape {}, got {}",
                                         self.shape, info.specs[1]->shape));
    }
    s.inputs[1] = self.placements;
  } else if (info.num_args() > 1 && info.arg(1).isTensor() && info.arg(1).toTensor().dim() > 0) {
    fail_unsupported(info, "the probabilities must be a DTensor or a 0-dim tensor");
  }
  s.local_kernel = fill_in_place;
  return s;
}

// Out of place (bernoulli, native_dropout): a Partial input is reduced first (as PyTorch's
// random-op strategies, which take no Partial); every output has the input's layout.
OpSharding random_out_of_place(const OpInfo& info) {
  const DTensorSpec& self = *info.specs[0];
  if (info.name != "aten::native_dropout") {
    (void)distribution_of(info, self.dtype);
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  const Placements out = without_partial(self.placements);
  s.inputs[0] = out;
  const size_t nret = info.op->schema().returns().size();
  for (size_t r = 0; r < nret; ++r) {
    s.outputs.push_back(out);
    s.output_shapes.push_back(self.shape);
  }
  s.local_kernel = info.name == "aten::native_dropout" ? dropout_local : bernoulli_out_of_place;
  return s;
}

} // namespace

void register_random_ops() {
  for (const char* name :
       {"aten::uniform_", "aten::normal_", "aten::bernoulli_.float", "aten::bernoulli_.Tensor",
        "aten::random_", "aten::random_.from", "aten::random_.to", "aten::exponential_",
        "aten::log_normal_", "aten::cauchy_", "aten::geometric_"}) {
    register_rule(name, random_in_place);
  }
  for (const char* name : {"aten::bernoulli", "aten::bernoulli.p", "aten::native_dropout"}) {
    register_rule(name, random_out_of_place);
  }
}

} // namespace dtensor::detail

// The plain-tensor reference: the whole tensor is one box.
namespace dtensor {

namespace {

void fill_plain(at::Tensor& t, const detail::Distribution& d, const char* what) {
  DTENSOR_CHECK(t.defined(), "dtensor::{}: undefined tensor", what);
  at::NoGradGuard no_grad;
  detail::Box box{t.sizes().vec(), std::vector<int64_t>(t.dim(), 0)};
  detail::fill_box(t, box, detail::next_draw(std::nullopt, what), d);
}

} // namespace

at::Tensor& normal_(at::Tensor& t, double mean, double std) {
  if (is_dtensor(t)) {
    return t.normal_(mean, std);
  }
  DTENSOR_CHECK(std >= 0.0, "dtensor::normal_: expects std >= 0.0, got std={}", std);
  fill_plain(t, {detail::Distribution::kNormal, mean, std}, "normal_");
  return t;
}

at::Tensor& uniform_(at::Tensor& t, double from, double to) {
  if (is_dtensor(t)) {
    return t.uniform_(from, to);
  }
  DTENSOR_CHECK(from <= to, "dtensor::uniform_: expects from <= to, got from={} to={}", from, to);
  fill_plain(t, {detail::Distribution::kUniform, from, to}, "uniform_");
  return t;
}

at::Tensor& trunc_normal_(at::Tensor& t, double mean, double std, double a, double b) {
  DTENSOR_CHECK(a < b && std > 0.0,
                "dtensor::trunc_normal_: expects a < b and std > 0, got a={} b={} std={}", a, b,
                std);
  // Inverse CDF: uniform in [cdf(a), cdf(b)] mapped through the normal quantile.
  auto cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
  const double lo = cdf((a - mean) / std);
  const double hi = cdf((b - mean) / std);
  at::NoGradGuard no_grad;
  uniform_(t, 2.0 * lo - 1.0, 2.0 * hi - 1.0);
  t.erfinv_().mul_(std * std::sqrt(2.0)).add_(mean).clamp_(a, b);
  return t;
}

at::Tensor dropout(const at::Tensor& input, double p, bool train) {
  DTENSOR_CHECK(p >= 0.0 && p <= 1.0,
                "dtensor::dropout: dropout probability has to be between 0 and 1, got {}", p);
  if (is_dtensor(input)) {
    return at::dropout(input, p, train);
  }
  if (!train || p == 0.0 || input.numel() == 0) {
    return input;
  }
  if (p == 1.0) {
    return input * 0.0; // no draw, as ATen's dropout (and so the DTensor path) for p = 1
  }
  at::Tensor mask = at::empty(input.sizes(), input.options().dtype(at::kBool));
  fill_plain(mask, {detail::Distribution::kBernoulli, 1.0 - p}, "dropout");
  return input * mask * (1.0 / (1.0 - p));
}

} // namespace dtensor
