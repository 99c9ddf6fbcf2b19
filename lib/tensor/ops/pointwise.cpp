// Pointwise ops (unary, binary, ternary; in-place and out= variants) with broadcasting.
#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

// [Note: Partial placements through pointwise ops]
// A Partial input passes through an op (no communication) only when the op commutes with
// the partial's reduction; otherwise it is reduced (Replicate) first:
// - sum / avg: linear ops. neg, mul / div by constants, add / sub of partial sums. A
//   Replicate operand of add / sub joins a partial sum by partition (each rank adds y / k),
//   a partial average as it is (avg(x_r + y) = avg(x_r) + y).
// - max / min: monotone ops. Non-decreasing unary functions keep the op (max f(x_r) =
//   f(max x_r)), neg swaps max and min, adding a constant keeps it, multiplying by a scalar
//   keeps it (> 0) or swaps it (< 0).
// - norm partials and product: nothing passes.
enum class Linearity {
  None,     // any Partial input is reduced first
  Unary,    // linear in its only tensor argument (neg)
  Additive, // add / sub
  Product,  // mul: linear in one partial factor when the others are Replicate or constants
  Quotient, // div: linear in a partial numerator over a Replicate or constant denominator
};

Linearity linearity(const std::string& base) {
  static const std::vector<std::pair<const char*, Linearity>> table = {
      {"aten::neg", Linearity::Unary},    {"aten::neg_", Linearity::Unary},
      {"aten::add", Linearity::Additive}, {"aten::add_", Linearity::Additive},
      {"aten::sub", Linearity::Additive}, {"aten::sub_", Linearity::Additive},
      {"aten::mul", Linearity::Product},  {"aten::mul_", Linearity::Product},
      {"aten::div", Linearity::Quotient}, {"aten::div_", Linearity::Quotient},
  };
  for (const auto& [name, lin] : table) {
    if (base == name) {
      return lin;
    }
  }
  return Linearity::None;
}

// Unary ops that are non-decreasing on every real input (no NaN from a finite input), so
// max / min partials pass through them.
bool monotone_unary(const std::string& base) {
  static const char* const names[] = {
      "exp",   "exp2",      "expm1",     "sigmoid",  "tanh",       "relu",  "atan",
      "asinh", "sinh",      "erf",       "floor",    "ceil",       "trunc", "round",
      "clamp", "clamp_min", "clamp_max", "hardtanh", "nan_to_num",
  };
  for (const char* n : names) {
    std::string full = std::string("aten::") + n;
    if (base == full || base == full + "_") {
      return true;
    }
  }
  return false;
}

struct TensorArg {
  size_t index;
  const DTensorSpec* spec;
};

bool plain_partial(const Placement& p, ReduceOp op) {
  return p.is_partial() && !p.is_norm_partial() && p.reduce_op() == op;
}

ReduceOp swapped(ReduceOp op) {
  return op == ReduceOp::Max ? ReduceOp::Min : ReduceOp::Max;
}

// The sign of the op's Scalar argument (mul.Scalar, div.Scalar), 0 when it has none.
int scalar_sign(const OpInfo& info) {
  if (info.num_args() > 1 && info.arg(1).isScalar() && !info.arg(1).isComplexDouble()) {
    double v = info.arg(1).toScalar().toDouble();
    return v > 0 ? 1 : (v < 0 ? -1 : 0);
  }
  return 0;
}

// The placement of the output on mesh dim i when the Partial inputs there can pass through
// the op without communication (see the note), nullopt when they must be reduced first.
// What decides whether a pointwise op keeps a Partial on mesh dim i.
struct PartialUse {
  Placement partial = Placement::replicate(); // the (one) Partial among the operands
  size_t count = 0;                           // operands with it
  bool others_replicate = true; // every non-partial DTensor operand is Replicate on dim i
  bool plain_tensor = false;    // a plain 0-dim tensor: a constant of unknown value
  bool scalar_other = false;    // argument 1 is a Scalar
  bool partial_first = false;   // argument 0 is the partial operand
  Linearity lin = Linearity::None;
};

// nullopt: no Partial on dim i, or one the op cannot keep (norm partials, different ones).
std::optional<PartialUse> partial_use(const OpInfo& info, const std::vector<TensorArg>& args,
                                      size_t i, const std::string& base) {
  PartialUse u;
  for (const auto& t : args) {
    const Placement& p = t.spec->placements[i];
    if (!p.is_partial()) {
      u.others_replicate = u.others_replicate && p.is_replicate();
      continue;
    }
    if (p.is_norm_partial() || (u.count > 0 && !(u.partial == p))) {
      return std::nullopt;
    }
    u.partial = p;
    ++u.count;
  }
  if (u.count == 0) {
    return std::nullopt;
  }
  for (size_t a = 0; a < info.num_args(); ++a) {
    const c10::IValue& v = info.arg(a);
    u.plain_tensor = u.plain_tensor || (v.isTensor() && v.toTensor().defined() && !info.specs[a]);
  }
  u.scalar_other = info.num_args() > 1 && info.arg(1).isScalar();
  u.partial_first = args[0].index == 0 && args[0].spec->placements[i].is_partial();
  u.lin = linearity(base);
  // div with a rounding mode (floor, trunc) is not linear in its numerator.
  const auto& schema_args = info.op->schema().arguments();
  for (size_t a = 0; a < schema_args.size() && a < info.num_args(); ++a) {
    if (schema_args[a].name() == "rounding_mode" && !info.arg(a).isNone()) {
      u.lin = Linearity::None;
    }
  }
  return u;
}

// Partial sums / averages: linear ops keep them.
std::optional<Placement> sum_avg_result(const PartialUse& u, const std::vector<TensorArg>& args,
                                        size_t i) {
  const bool sum = u.partial.reduce_op() == ReduceOp::Sum;
  switch (u.lin) {
  case Linearity::Unary:
    return args.size() == 1 ? std::optional<Placement>(u.partial) : std::nullopt;
  case Linearity::Additive:
    // A constant cannot be partitioned over a partial sum; a partial average takes it.
    if (!u.others_replicate || (sum && (u.plain_tensor || u.scalar_other))) {
      return std::nullopt;
    }
    return u.partial;
  case Linearity::Product:
    return u.count == 1 && u.others_replicate ? std::optional<Placement>(u.partial) : std::nullopt;
  case Linearity::Quotient:
    return u.count == 1 && u.partial_first &&
                   (args.size() == 1 || args[1].spec->placements[i].is_replicate())
               ? std::optional<Placement>(u.partial)
               : std::nullopt;
  case Linearity::None:
    break;
  }
  return std::nullopt;
}

// Partial max / min: monotone ops keep them (decreasing ones swap max and min).
std::optional<Placement> max_min_result(const PartialUse& u, const OpInfo& info,
                                        const std::vector<TensorArg>& args,
                                        const std::string& base) {
  const ReduceOp op = u.partial.reduce_op();
  // Only the first argument may be the partial, every other input a constant.
  if (args.size() != 1 || !u.partial_first) {
    if (!(u.lin == Linearity::Additive && u.count == 1 && u.partial_first && u.others_replicate)) {
      return std::nullopt;
    }
    return u.partial; // max(x_r + y) = max(x_r) + y for y equal on every rank
  }
  if (monotone_unary(base)) {
    return u.partial;
  }
  if (u.lin == Linearity::Unary) {
    return Placement::partial(swapped(op));
  }
  if (u.lin == Linearity::Additive && !u.plain_tensor) {
    return u.partial; // x + c, x - c (a Scalar or nothing else)
  }
  if ((u.lin == Linearity::Product || u.lin == Linearity::Quotient) && u.scalar_other) {
    const int sign = scalar_sign(info);
    if (sign > 0 || (sign == 0 && u.lin == Linearity::Product)) {
      return u.partial;
    }
    if (sign < 0) {
      return Placement::partial(swapped(op));
    }
  }
  return std::nullopt;
}

std::optional<Placement> partial_result(const OpInfo& info, const std::vector<TensorArg>& args,
                                        size_t i, const std::string& base) {
  const std::optional<PartialUse> u = partial_use(info, args, i, base);
  if (!u) {
    return std::nullopt;
  }
  switch (u->partial.reduce_op()) {
  case ReduceOp::Sum:
  case ReduceOp::Avg:
    return sum_avg_result(*u, args, i);
  case ReduceOp::Max:
  case ReduceOp::Min:
    return max_min_result(*u, info, args, base);
  case ReduceOp::Product:
    break;
  }
  return std::nullopt;
}

// The broadcast of the DTensor arguments: the output's rank and shape, and which dim of an
// argument an output dim comes from.
struct Broadcast {
  int64_t out_ndim = 0;
  std::vector<int64_t> out_shape;
  // The argument's dim behind output dim `out_dim`; -1 where the argument is broadcast.
  int64_t arg_dim(const TensorArg& t, int64_t out_dim) const {
    int64_t d = out_dim - (out_ndim - t.spec->ndim());
    if (d < 0 || t.spec->shape[static_cast<size_t>(d)] != out_shape[static_cast<size_t>(out_dim)]) {
      return -1;
    }
    return d;
  }
  int64_t out_dim(const TensorArg& t, int64_t d) const { return d + (out_ndim - t.spec->ndim()); }
};

// A broadcast argument (fewer dims, or size 1 where another is larger) cannot be sharded on
// the broadcast dims.
Broadcast broadcast_of(const OpInfo& info, const std::vector<TensorArg>& args) {
  Broadcast bc;
  for (const auto& t : args) {
    bc.out_ndim = std::max(bc.out_ndim, t.spec->ndim());
  }
  bc.out_shape.assign(static_cast<size_t>(bc.out_ndim), 1);
  for (const auto& t : args) {
    for (int64_t d = 0; d < t.spec->ndim(); ++d) {
      int64_t& o = bc.out_shape[static_cast<size_t>(bc.out_dim(t, d))];
      int64_t size = t.spec->shape[static_cast<size_t>(d)];
      DTENSOR_CHECK(o == 1 || size == 1 || o == size,
                    "{}: shapes of the DTensor arguments do not broadcast: {}", info.name,
                    describe_args(info));
      o = size == 1 ? o : size; // broadcasting: a 0-size dim wins over 1
    }
  }
  return bc;
}

// In place, mesh dim i: the output is self, whose placement must survive the op.
Placement in_place_output(const OpInfo& info, const std::vector<TensorArg>& args, size_t i,
                          const std::string& base, const Broadcast& bc) {
  const Placement& self = args[0].spec->placements[i];
  if (self.is_shard()) {
    return Placement::shard(bc.out_dim(args[0], self.dim()));
  }
  if (self.is_partial()) {
    auto kept = partial_result(info, args, i, base);
    if (!kept || !(*kept == self)) {
      fail_unsupported(info, fmt::format("the in-place op cannot keep {} of its self argument on "
                                         "mesh dim {}; redistribute self first",
                                         self.to_string(), i));
    }
  }
  return self;
}

// Mesh dim i: follow the first argument sharded along a non-broadcast dim; else a Partial
// the op keeps ([Note: Partial placements through pointwise ops]); else Replicate.
Placement output_placement(const OpInfo& info, const std::vector<TensorArg>& args, size_t i,
                           const std::string& base, const Broadcast& bc) {
  for (const auto& t : args) {
    const Placement& p = t.spec->placements[i];
    if (p.is_shard()) {
      const int64_t od = bc.out_dim(t, p.dim());
      if (bc.arg_dim(t, od) >= 0) {
        return Placement::shard(od);
      }
    }
  }
  if (auto kept = partial_result(info, args, i, base)) {
    return *kept;
  }
  return Placement::replicate();
}

// What argument `t` must be for output placements `out`.
Placements input_placements(const TensorArg& t, const Placements& out, const Broadcast& bc,
                            Linearity lin) {
  Placements want(out.size(), Placement::replicate());
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].is_shard()) {
      int64_t d = bc.arg_dim(t, out[i].dim());
      want[i] = d >= 0 ? Placement::shard(d) : Placement::replicate();
    } else if (out[i].is_partial()) {
      // add/sub of partial sums: every operand becomes a partial sum (Replicate ones by
      // partition); otherwise every operand stays as it is (see the note).
      bool partition = lin == Linearity::Additive && plain_partial(out[i], ReduceOp::Sum);
      want[i] = partition ? out[i] : t.spec->placements[i];
    }
  }
  return want;
}

OpSharding pointwise_rule(const OpInfo& info) {
  const std::string base = info.op->schema().name();
  const auto& schema_args = info.op->schema().arguments();
  const bool in_place = !schema_args.empty() && schema_args[0].alias_info() != nullptr &&
                        schema_args[0].alias_info()->isWrite();
  std::vector<TensorArg> args;
  for (size_t a = 0; a < info.num_args(); ++a) {
    if (info.specs[a]) {
      args.push_back({a, &*info.specs[a]});
    }
  }
  const Broadcast bc = broadcast_of(info, args);
  const size_t mesh_ndim = static_cast<size_t>(info.mesh_ndim());
  Placements out(mesh_ndim, Placement::replicate());
  for (size_t i = 0; i < mesh_ndim; ++i) {
    out[i] = in_place ? in_place_output(info, args, i, base, bc)
                      : output_placement(info, args, i, base, bc);
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  const Linearity lin = linearity(base);
  for (const auto& t : args) {
    s.inputs[t.index] = input_placements(t, out, bc, lin);
  }
  // Some pointwise kernels have no Meta kernel in C++ (relu): the broadcast shape is known.
  // Ops returning more than one tensor (frexp) return them all of that shape.
  const size_t nret = info.op->schema().returns().size();
  s.outputs.assign(nret, out);
  s.output_shapes.assign(nret, bc.out_shape);
  return s;
}

} // namespace

void register_pointwise_ops() {
  static const char* const names[] = {
      // unary
      "abs",
      "neg",
      "sqrt",
      "rsqrt",
      "exp",
      "exp2",
      "log",
      "log2",
      "log1p",
      "expm1",
      "sin",
      "cos",
      "tan",
      "tanh",
      "sigmoid",
      "relu",
      "gelu",
      "silu",
      "mish",
      "sign",
      "sgn",
      "reciprocal",
      "floor",
      "ceil",
      "round",
      "trunc",
      "frac",
      "erf",
      "erfc",
      "erfinv",
      "bitwise_not",
      "logical_not",
      "isnan",
      "isinf",
      "nan_to_num",
      "clamp",
      "clamp_min",
      "clamp_max",
      "hardtanh",
      "leaky_relu",
      "elu",
      "softplus",
      "square",
      "pow",
      "signbit",
      "asin",
      "acos",
      "atan",
      "sinh",
      "cosh",
      "asinh",
      "acosh",
      "atanh",
      "digamma",
      "lgamma",
      "i0",
      "isneginf",
      "isposinf",
      "log10",
      "sinc",
      "logit",
      "angle",
      "deg2rad",
      "rad2deg",
      "hardshrink",
      "softshrink",
      "hardsigmoid",
      "hardswish",
      "celu",
      "threshold",
      "polygamma",
      "mvlgamma",
      "special_airy_ai",
      "special_bessel_j0",
      "special_bessel_j1",
      "special_bessel_y0",
      "special_bessel_y1",
      "special_entr",
      "special_erfcx",
      "special_i0e",
      "special_i1",
      "special_i1e",
      "special_log_ndtr",
      "special_modified_bessel_i0",
      "special_modified_bessel_i1",
      "special_modified_bessel_k0",
      "special_modified_bessel_k1",
      "special_ndtri",
      "special_scaled_modified_bessel_k0",
      "special_scaled_modified_bessel_k1",
      "special_spherical_bessel_j0",
      // binary
      "add",
      "sub",
      "mul",
      "div",
      "rsub",
      "maximum",
      "minimum",
      "fmax",
      "fmin",
      "remainder",
      "fmod",
      "eq",
      "ne",
      "lt",
      "le",
      "gt",
      "ge",
      "logical_and",
      "logical_or",
      "logical_xor",
      "bitwise_and",
      "bitwise_or",
      "bitwise_xor",
      "atan2",
      "hypot",
      "copysign",
      "xlogy",
      "masked_fill",
      "heaviside",
      "igamma",
      "igammac",
      "logaddexp",
      "logaddexp2",
      "nextafter",
      "floor_divide",
      "ldexp",
      "frexp",
      "special_xlog1py",
      "special_zeta",
      "special_chebyshev_polynomial_t",
      "special_chebyshev_polynomial_u",
      "special_chebyshev_polynomial_v",
      "special_chebyshev_polynomial_w",
      "special_shifted_chebyshev_polynomial_t",
      "special_shifted_chebyshev_polynomial_u",
      "special_shifted_chebyshev_polynomial_v",
      "special_shifted_chebyshev_polynomial_w",
      "special_hermite_polynomial_h",
      "special_hermite_polynomial_he",
      "special_laguerre_polynomial_l",
      "special_legendre_polynomial_p",
      // ternary
      "where",
      "lerp",
      "addcmul",
      "addcdiv",
      // backward kernels
      "threshold_backward",
      "gelu_backward",
      "silu_backward",
      "sigmoid_backward",
      "tanh_backward",
      "hardtanh_backward",
      "leaky_relu_backward",
      "elu_backward",
      "softplus_backward",
      "mish_backward",
      "native_dropout_backward",
  };
  for (const char* n : names) {
    std::string base = std::string("aten::") + n;
    register_rule(base, pointwise_rule, /*scalar_sign_only=*/true);
    register_rule(base + "_", pointwise_rule, /*scalar_sign_only=*/true);
  }
  // Elementwise overloads of names that are reductions otherwise.
  register_rule("aten::max.other", pointwise_rule, true);
  register_rule("aten::min.other", pointwise_rule, true);
}

} // namespace dtensor::detail
