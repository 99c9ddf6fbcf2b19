// Reductions: sum, mean, amax, amin, max/min (full), linalg_vector_norm. A reduction over a
// sharded dimension gives a Partial result; the reduction itself stays local.
#include <algorithm>
#include <cmath>

#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

enum class Kind { Sum, Mean, Max, Min, Norm };

struct Reduced {
  std::vector<bool> dims; // per input dim: reduced?
  bool keepdim = false;
};

// Reads `dim` (int[]? / int) and `keepdim` from the op's arguments by name.
Reduced reduced_dims(const OpInfo& info, int64_t ndim) {
  Reduced r;
  r.dims.assign(static_cast<size_t>(ndim), false);
  const auto& schema_args = info.op->schema().arguments();
  bool have_dim = false;
  for (size_t a = 0; a < schema_args.size(); ++a) {
    const std::string& n = schema_args[a].name();
    const c10::IValue& v = info.arg(a);
    if (n == "dim") {
      if (v.isIntList()) {
        auto list = v.toIntVector();
        have_dim = !list.empty();
        for (int64_t d : list) {
          r.dims[static_cast<size_t>(d < 0 ? d + ndim : d)] = true;
        }
      } else if (v.isInt()) {
        int64_t d = v.toInt();
        have_dim = true;
        r.dims[static_cast<size_t>(d < 0 ? d + ndim : d)] = true;
      }
    } else if (n == "keepdim" && v.isBool()) {
      r.keepdim = v.toBool();
    }
  }
  if (!have_dim) {
    r.dims.assign(static_cast<size_t>(ndim), true); // no dim list: a full reduction
  }
  return r;
}

double norm_ord(const OpInfo& info) {
  const auto& schema_args = info.op->schema().arguments();
  for (size_t a = 0; a < schema_args.size(); ++a) {
    if (schema_args[a].name() == "ord" && info.arg(a).isScalar()) {
      return info.arg(a).toScalar().toDouble();
    }
  }
  return 2.0;
}

// The smallest and largest piece of each tensor dim over every rank of the mesh.
struct PieceRange {
  std::vector<int64_t> min, max;
};

PieceRange piece_range(const DTensorSpec& in) {
  const DeviceMesh& mesh = in.mesh;
  PieceRange r{in.shape, std::vector<int64_t>(in.shape.size(), 0)};
  std::vector<int64_t> coord(static_cast<size_t>(mesh.ndim()), 0);
  int64_t total = 1;
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    total *= mesh.size(i);
  }
  for (int64_t linear = 0; linear < total; ++linear) {
    int64_t rest = linear;
    for (auto i = static_cast<size_t>(mesh.ndim()); i-- > 0;) {
      coord[i] = rest % mesh.size(static_cast<int64_t>(i));
      rest /= mesh.size(static_cast<int64_t>(i));
    }
    auto local = in.local_shape(coord);
    for (size_t d = 0; d < local.size(); ++d) {
      r.min[d] = std::min(r.min[d], local[d]);
      r.max[d] = std::max(r.max[d], local[d]);
    }
  }
  return r;
}

// Must the sharded reduced dims be gathered before reducing?
// - max / min of nothing is an error, which would be raised on the ranks holding an empty
//   piece only while the others wait in the reduction: gather when some piece of a
//   non-empty reduced dim is empty, so every rank computes the same (and raises the same
//   error only when the plain op would).
// - local means average to the global mean only when every piece has the same size (with
//   nested shards, the pieces of the last cut, not the first).
bool gather_reduced_dims(const DTensorSpec& in, const Reduced& r, Kind kind) {
  if (kind != Kind::Max && kind != Kind::Min && kind != Kind::Mean) {
    return false;
  }
  bool sharded = false;
  for (const auto& p : in.placements) {
    sharded = sharded || (p.is_shard() && r.dims[static_cast<size_t>(p.dim())]);
  }
  if (!sharded) {
    return false;
  }
  const PieceRange range = piece_range(in);
  for (size_t d = 0; d < in.shape.size(); ++d) {
    if (!r.dims[d]) {
      continue;
    }
    if (kind == Kind::Mean ? range.min[d] != range.max[d]
                           : (range.min[d] == 0 && in.shape[d] > 0)) {
      return true;
    }
  }
  return false;
}

// The Partial a reduction of `kind` leaves where it reduces a sharded dim (nullopt: the dim
// must be gathered first: negative finite norm orders do not combine from the pieces).
std::optional<Placement> reduced_shard_result(const OpInfo& info, Kind kind) {
  switch (kind) {
  case Kind::Sum:
    return Placement::partial(ReduceOp::Sum);
  case Kind::Mean: // equal pieces (gather_reduced_dims)
    return Placement::partial(ReduceOp::Avg);
  case Kind::Max:
    return Placement::partial(ReduceOp::Max);
  case Kind::Min:
    return Placement::partial(ReduceOp::Min);
  case Kind::Norm:
    break;
  }
  const double q = norm_ord(info);
  if (q >= 0 || std::isinf(q)) {
    return Placement::partial_norm(q);
  }
  return std::nullopt;
}

// Whether a Partial input passes through a reduction of `kind` unchanged (sums and means of
// sums / averages; max of max; min of min).
bool partial_passes(const Placement& p, Kind kind) {
  if (p.is_norm_partial()) {
    return false;
  }
  const bool linear = (kind == Kind::Sum || kind == Kind::Mean) &&
                      (p.reduce_op() == ReduceOp::Sum || p.reduce_op() == ReduceOp::Avg);
  const bool same = (kind == Kind::Max && p.reduce_op() == ReduceOp::Max) ||
                    (kind == Kind::Min && p.reduce_op() == ReduceOp::Min);
  return linear || same;
}

// The output dim of input dim d (reduced dims before it disappear without keepdim).
int64_t kept_dim(const Reduced& r, size_t d) {
  int64_t shift = 0;
  if (!r.keepdim) {
    for (size_t k = 0; k < d; ++k) {
      shift += r.dims[k] ? 1 : 0;
    }
  }
  return static_cast<int64_t>(d) - shift;
}

OpSharding reduce(const OpInfo& info, Kind kind) {
  const DTensorSpec& in = *info.specs[0];
  Reduced r = reduced_dims(info, in.ndim());
  const size_t mesh_ndim = static_cast<size_t>(info.mesh_ndim());
  // Reductions that also return indices need the whole reduced dimension.
  const bool with_indices = info.op->schema().returns().size() > 1;
  const bool gather_reduced = with_indices || gather_reduced_dims(in, r, kind);
  Placements want = in.placements;
  Placements out(mesh_ndim, Placement::replicate());
  for (size_t i = 0; i < mesh_ndim; ++i) {
    const Placement& p = in.placements[i];
    if (p.is_shard()) {
      const auto d = static_cast<size_t>(p.dim());
      const std::optional<Placement> reduced =
          r.dims[d] && !gather_reduced ? reduced_shard_result(info, kind) : std::nullopt;
      if (!r.dims[d]) {
        out[i] = Placement::shard(kept_dim(r, d));
      } else if (reduced) {
        out[i] = *reduced;
      } else {
        want[i] = Placement::replicate();
      }
    } else if (p.is_partial()) {
      if (partial_passes(p, kind)) {
        out[i] = p;
      } else {
        want[i] = Placement::replicate();
      }
    }
  }
  // max.dim / min.dim also return indices: only meaningful when nothing was sharded away.
  if (with_indices) {
    for (size_t i = 0; i < mesh_ndim; ++i) {
      if (out[i].is_partial()) {
        want[i] = Placement::replicate(); // a Partial input: reduce it first
        out[i] = Placement::replicate();
      }
    }
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = want;
  s.outputs.push_back(out);
  if (with_indices) {
    s.outputs.push_back(out);
  }
  return s;
}

OpSharding sum_rule(const OpInfo& info) {
  return reduce(info, Kind::Sum);
}
OpSharding mean_rule(const OpInfo& info) {
  return reduce(info, Kind::Mean);
}
OpSharding max_rule(const OpInfo& info) {
  return reduce(info, Kind::Max);
}
OpSharding min_rule(const OpInfo& info) {
  return reduce(info, Kind::Min);
}
OpSharding norm_rule(const OpInfo& info) {
  return reduce(info, Kind::Norm);
}

} // namespace

void register_reduction_ops() {
  register_rule("aten::sum", sum_rule);
  register_rule("aten::mean", mean_rule);
  register_rule("aten::amax", max_rule);
  register_rule("aten::amin", min_rule);
  register_rule("aten::max", max_rule);
  register_rule("aten::min", min_rule);
  register_rule("aten::linalg_vector_norm", norm_rule);
}

} // namespace dtensor::detail
