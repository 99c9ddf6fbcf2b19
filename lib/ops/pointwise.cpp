// Pointwise ops (unary, binary, ternary; in-place and out= variants) with broadcasting.
#include "../internal/check.h"
#include "../internal/sharding.h"

namespace dtensor::detail {

namespace {

// How a Partial(sum) input may pass through an op.
enum class Linearity {
  None,     // any Partial input is reduced first
  Unary,    // f(sum x) = sum f(x) for the first tensor argument (neg, mul/div by scalars)
  Additive, // add / sub: linear when every tensor argument is Partial(sum)
  Product,  // mul: linear in one Partial(sum) factor when the others are Replicate
  Quotient, // div: linear in a Partial(sum) numerator over a Replicate denominator
};

Linearity linearity(const std::string& base) {
  static const std::vector<std::pair<const char*, Linearity>> table = {
      {"aten::neg", Linearity::Unary},      {"aten::neg_", Linearity::Unary},
      {"aten::add", Linearity::Additive},   {"aten::add_", Linearity::Additive},
      {"aten::sub", Linearity::Additive},   {"aten::sub_", Linearity::Additive},
      {"aten::mul", Linearity::Product},    {"aten::mul_", Linearity::Product},
      {"aten::div", Linearity::Quotient},   {"aten::div_", Linearity::Quotient},
  };
  for (const auto& [name, lin] : table) {
    if (base == name) {
      return lin;
    }
  }
  return Linearity::None;
}

struct TensorArg {
  size_t index;
  const DTensorSpec* spec;
};

bool is_sum_partial(const Placement& p) {
  return p.is_partial() && !p.is_norm_partial() && p.reduce_op() == ReduceOp::Sum;
}

// Does every other argument allow `p`'s Partial(sum) to pass at mesh dim i?
bool partial_passes(const OpInfo& info, const std::vector<TensorArg>& args, size_t i, Linearity lin) {
  size_t partial_count = 0;
  bool plain_tensor = false;
  for (size_t a = 0; a < info.num_args(); ++a) {
    const c10::IValue& v = info.arg(a);
    if (v.isTensor() && v.toTensor().defined() && !info.specs[a]) {
      plain_tensor = true; // a 0-dim plain tensor acts like a scalar constant
    }
  }
  bool sum_partial_or_replicate = true; // every DTensor operand, on mesh dim i
  for (const auto& t : args) {
    const Placement& p = t.spec->placements[i];
    partial_count += is_sum_partial(p) ? 1 : 0;
    sum_partial_or_replicate = sum_partial_or_replicate && (is_sum_partial(p) || p.is_replicate());
  }
  switch (lin) {
  case Linearity::Unary:
    return args.size() == 1;
  case Linearity::Additive: {
    // x + y stays a partial sum when both are partial sums; a Replicate operand joins as a
    // partial sum by partition (each rank adds y / k: no communication), as PyTorch does.
    // A constant (Scalar or plain 0-dim tensor) cannot be partitioned here.
    bool scalar_other = info.num_args() > 1 && info.arg(1).isScalar();
    return !plain_tensor && !scalar_other && partial_count > 0 && sum_partial_or_replicate;
  }
  case Linearity::Product:
    return partial_count == 1 && sum_partial_or_replicate;
  case Linearity::Quotient:
    return partial_count == 1 && is_sum_partial(args[0].spec->placements[i]) &&
           (args.size() == 1 || args[1].spec->placements[i].is_replicate());
  case Linearity::None:
    return false;
  }
  return false;
}

OpSharding pointwise_rule(const OpInfo& info) {
  const std::string base = info.op->schema().name();
  const bool in_place = !info.op->schema().arguments().empty() &&
                        info.op->schema().arguments()[0].alias_info() != nullptr &&
                        info.op->schema().arguments()[0].alias_info()->isWrite();
  std::vector<TensorArg> args;
  for (size_t a = 0; a < info.num_args(); ++a) {
    if (info.specs[a]) {
      args.push_back({a, &*info.specs[a]});
    }
  }
  // The output has the largest rank; an argument's dim d maps to output dim d + offset.
  int64_t out_ndim = 0;
  for (const auto& t : args) {
    out_ndim = std::max(out_ndim, t.spec->ndim());
  }
  // A broadcast argument (fewer dims, or size 1 where another is larger) cannot be
  // sharded on the broadcast dims.
  std::vector<int64_t> out_shape(static_cast<size_t>(out_ndim), 1);
  for (const auto& t : args) {
    int64_t off = out_ndim - t.spec->ndim();
    for (int64_t d = 0; d < t.spec->ndim(); ++d) {
      out_shape[static_cast<size_t>(d + off)] =
          std::max(out_shape[static_cast<size_t>(d + off)], t.spec->shape[static_cast<size_t>(d)]);
    }
  }
  auto arg_dim = [&](const TensorArg& t, int64_t out_dim) -> int64_t {
    int64_t d = out_dim - (out_ndim - t.spec->ndim());
    if (d < 0 || t.spec->shape[static_cast<size_t>(d)] != out_shape[static_cast<size_t>(out_dim)]) {
      return -1; // broadcast along this dim
    }
    return d;
  };

  const size_t mesh_ndim = static_cast<size_t>(info.mesh_ndim());
  Placements out(mesh_ndim, Placement::replicate());
  Linearity lin = linearity(base);
  for (size_t i = 0; i < mesh_ndim; ++i) {
    if (in_place) {
      const Placement& self = args[0].spec->placements[i];
      if (self.is_shard()) {
        out[i] = Placement::shard(self.dim() + (out_ndim - args[0].spec->ndim()));
      } else if (self.is_partial()) {
        if (!(is_sum_partial(self) && partial_passes(info, args, i, lin))) {
          fail_unsupported(info, fmt::format("the in-place op cannot keep {} of its self argument on "
                                             "mesh dim {}; redistribute self first",
                                             self.to_string(), i));
        }
        out[i] = self;
      }
      continue;
    }
    // Follow the first argument sharded (along a non-broadcast dim) on this mesh dim.
    bool decided = false;
    for (const auto& t : args) {
      const Placement& p = t.spec->placements[i];
      if (p.is_shard()) {
        int64_t od = p.dim() + (out_ndim - t.spec->ndim());
        if (arg_dim(t, od) >= 0) {
          out[i] = Placement::shard(od);
          decided = true;
          break;
        }
      }
    }
    if (!decided) {
      bool any_partial = false;
      for (const auto& t : args) {
        any_partial = any_partial || t.spec->placements[i].is_partial();
      }
      if (any_partial && partial_passes(info, args, i, lin)) {
        out[i] = Placement::partial(ReduceOp::Sum);
      }
    }
  }

  OpSharding s;
  s.inputs.resize(info.num_args());
  for (const auto& t : args) {
    Placements want(mesh_ndim, Placement::replicate());
    for (size_t i = 0; i < mesh_ndim; ++i) {
      if (out[i].is_shard()) {
        int64_t d = arg_dim(t, out[i].dim());
        want[i] = d >= 0 ? Placement::shard(d) : Placement::replicate();
      } else if (out[i].is_partial()) {
        // add/sub: every operand becomes a partial sum (Replicate ones by partition);
        // mul/div: linear in the partial factor, the others stay Replicate.
        want[i] = lin == Linearity::Additive ? Placement::partial(ReduceOp::Sum) : t.spec->placements[i];
      }
    }
    s.inputs[t.index] = want;
  }
  s.outputs.push_back(out);
  // Some pointwise kernels have no Meta kernel in C++ (relu): the broadcast shape is known.
  // Boolean/complex ops returning more than one tensor are not pointwise.
  if (info.op->schema().returns().size() == 1) {
    s.output_shapes.push_back(out_shape);
  }
  return s;
}

} // namespace

void register_pointwise_ops() {
  static const char* const names[] = {
      // unary
      "abs", "neg", "sqrt", "rsqrt", "exp", "exp2", "log", "log2", "log1p", "expm1", "sin", "cos",
      "tan", "tanh", "sigmoid", "relu", "gelu", "silu", "mish", "sign", "sgn", "reciprocal", "floor",
      "ceil", "round", "trunc", "frac", "erf", "erfc", "erfinv", "bitwise_not", "logical_not", "isnan",
      "isinf", "nan_to_num", "clamp", "clamp_min", "clamp_max", "hardtanh", "leaky_relu", "elu",
      "softplus", "square", "pow", "signbit", "asin", "acos", "atan", "sinh", "cosh", "asinh",
      "acosh", "atanh",
      // binary
      "add", "sub", "mul", "div", "rsub", "maximum", "minimum", "fmax", "fmin", "remainder", "fmod",
      "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "bitwise_and",
      "bitwise_or", "bitwise_xor", "atan2", "hypot", "copysign", "xlogy", "masked_fill",
      // ternary
      "where", "lerp", "addcmul", "addcdiv",
      // backward kernels
      "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
      "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward",
      "mish_backward", "native_dropout_backward",
  };
  for (const char* n : names) {
    std::string base = std::string("aten::") + n;
    register_rule(base, pointwise_rule);
    register_rule(base + "_", pointwise_rule);
  }
  // Elementwise overloads of names that are reductions otherwise.
  register_rule("aten::max.other", pointwise_rule);
  register_rule("aten::min.other", pointwise_rule);
}

} // namespace dtensor::detail
