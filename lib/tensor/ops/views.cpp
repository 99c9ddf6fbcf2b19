// View and shape ops: t, transpose, permute, view / _unsafe_view / _reshape_alias,
// unsqueeze, squeeze, expand, slice, select. Shards follow their dimension; a shard that
// the view would cut across is gathered first.
#include <ATen/ops/squeeze.h>

#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

// Rebuild placements through a map from input dims to output dims (-1: cannot follow).
OpSharding map_dims(const OpInfo& info, const std::vector<int64_t>& to_out) {
  const DTensorSpec& in = *info.specs[0];
  Placements want = in.placements;
  Placements out = in.placements;
  for (size_t i = 0; i < out.size(); ++i) {
    if (in.placements[i].is_shard()) {
      int64_t od = to_out[static_cast<size_t>(in.placements[i].dim())];
      if (od < 0) {
        want[i] = Placement::replicate();
        out[i] = Placement::replicate();
      } else {
        out[i] = Placement::shard(od);
      }
    }
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = want;
  s.outputs.push_back(out);
  return s;
}

std::vector<int64_t> identity(int64_t n) {
  std::vector<int64_t> m(static_cast<size_t>(n));
  for (int64_t d = 0; d < n; ++d) {
    m[static_cast<size_t>(d)] = d;
  }
  return m;
}

OpSharding transpose_rule(const OpInfo& info) {
  int64_t n = info.specs[0]->ndim();
  auto m = identity(n);
  if (n >= 2) {
    int64_t a = info.num_args() > 1 ? wrap_dim(info.arg(1).toInt(), n) : 0;
    int64_t b = info.num_args() > 2 ? wrap_dim(info.arg(2).toInt(), n) : 1;
    std::swap(m[static_cast<size_t>(a)], m[static_cast<size_t>(b)]);
  }
  return map_dims(info, m);
}

OpSharding permute_rule(const OpInfo& info) {
  int64_t n = info.specs[0]->ndim();
  auto dims = info.arg(1).toIntVector();
  std::vector<int64_t> m(static_cast<size_t>(n), -1);
  for (size_t o = 0; o < dims.size(); ++o) {
    m[static_cast<size_t>(wrap_dim(dims[o], n))] = static_cast<int64_t>(o);
  }
  return map_dims(info, m);
}

OpSharding unsqueeze_rule(const OpInfo& info) {
  int64_t n = info.specs[0]->ndim();
  int64_t at = wrap_dim(info.arg(1).toInt(), n + 1);
  std::vector<int64_t> m(static_cast<size_t>(n));
  for (int64_t d = 0; d < n; ++d) {
    m[static_cast<size_t>(d)] = d < at ? d : d + 1;
  }
  return map_dims(info, m);
}

// The dims squeeze drops: those named (all when none are) whose global size is 1.
std::vector<bool> squeezed(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  int64_t n = in.ndim();
  std::vector<bool> drop(static_cast<size_t>(n), false);
  if (info.num_args() > 1 && info.arg(1).isInt()) {
    int64_t d = wrap_dim(info.arg(1).toInt(), n);
    drop[static_cast<size_t>(d)] = in.shape[static_cast<size_t>(d)] == 1;
  } else if (info.num_args() > 1 && info.arg(1).isIntList()) {
    for (int64_t d : info.arg(1).toIntVector()) {
      d = wrap_dim(d, n);
      drop[static_cast<size_t>(d)] = in.shape[static_cast<size_t>(d)] == 1;
    }
  } else {
    for (int64_t d = 0; d < n; ++d) {
      drop[static_cast<size_t>(d)] = in.shape[static_cast<size_t>(d)] == 1;
    }
  }
  return drop;
}

// [Note: squeeze by the global shape] A shard can have size 1 where the global dim does
// not (3 rows over 2 ranks: 2 + 1), and a local squeeze would drop it on that rank only.
// The local op squeezes exactly the dims the global op drops.
void squeeze_local(const OpInfo& info, const OpSharding&, torch::jit::Stack* stack) {
  const std::vector<bool> drop = squeezed(info);
  std::vector<int64_t> dims;
  for (size_t d = 0; d < drop.size(); ++d) {
    if (drop[d]) {
      dims.push_back(static_cast<int64_t>(d));
    }
  }
  const size_t nargs = info.op->schema().arguments().size();
  const at::Tensor self = (*stack)[stack->size() - nargs].toTensor();
  stack->erase(stack->end() - static_cast<std::ptrdiff_t>(nargs), stack->end());
  stack->emplace_back(at::squeeze(self, dims));
}

OpSharding squeeze_rule(const OpInfo& info) {
  const std::vector<bool> drop = squeezed(info);
  const int64_t n = info.specs[0]->ndim();
  std::vector<int64_t> m(static_cast<size_t>(n), -1);
  int64_t o = 0;
  for (int64_t d = 0; d < n; ++d) {
    if (!drop[static_cast<size_t>(d)]) {
      m[static_cast<size_t>(d)] = o++;
    }
  }
  OpSharding s = map_dims(info, m);
  s.local_kernel = squeeze_local;
  return s;
}

OpSharding expand_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  const std::vector<int64_t> size = info.arg(1).toIntVector();
  const int64_t off = static_cast<int64_t>(size.size()) - in.ndim();
  std::vector<int64_t> m(static_cast<size_t>(in.ndim()));
  for (int64_t d = 0; d < in.ndim(); ++d) {
    // A dim of size 1 being expanded is whole on every rank first: sharded, it is one row on
    // one rank and none on the others.
    const int64_t target = size[static_cast<size_t>(d + off)];
    const bool expanded = in.shape[static_cast<size_t>(d)] == 1 && target != 1 && target != -1;
    m[static_cast<size_t>(d)] = expanded ? -1 : d + off;
  }
  return map_dims(info, m); // the size becomes local: [Note: shape arguments]
}

// slice / select along a sharded dim need the whole dim; elsewhere the shard follows.
OpSharding slice_rule(const OpInfo& info) {
  int64_t n = info.specs[0]->ndim();
  int64_t dim = info.num_args() > 1 && info.arg(1).isInt() ? wrap_dim(info.arg(1).toInt(), n) : 0;
  auto m = identity(n);
  m[static_cast<size_t>(dim)] = -1;
  return map_dims(info, m);
}

OpSharding select_rule(const OpInfo& info) {
  int64_t n = info.specs[0]->ndim();
  int64_t dim = wrap_dim(info.arg(1).toInt(), n);
  std::vector<int64_t> m(static_cast<size_t>(n));
  for (int64_t d = 0; d < n; ++d) {
    m[static_cast<size_t>(d)] = d < dim ? d : (d == dim ? -1 : d - 1);
  }
  return map_dims(info, m);
}

// view: group input and output dims whose products match; a shard survives on the first
// dimension of its group when every nested cut of it stays contiguous and even.
// view's size argument with its -1 inferred, checked against the input's element count.
std::vector<int64_t> view_size(const OpInfo& info, const DTensorSpec& in, int64_t numel) {
  std::vector<int64_t> out = info.arg(1).toIntVector();
  int64_t known = 1;
  int64_t infer = -1;
  for (size_t o = 0; o < out.size(); ++o) {
    if (out[o] == -1) {
      DTENSOR_CHECK(infer < 0, "{}: only one dimension can be inferred in {}", info.name, out);
      infer = static_cast<int64_t>(o);
    } else {
      DTENSOR_CHECK(out[o] >= 0, "{}: invalid size {} in {}", info.name, out[o], out);
      known *= out[o];
    }
  }
  if (infer >= 0) {
    DTENSOR_CHECK(known != 0,
                  "{}: cannot infer the -1 in {} for a tensor of shape {} (0 elements "
                  "elsewhere)",
                  info.name, out, in.shape);
    out[static_cast<size_t>(infer)] = numel / known;
    known *= out[static_cast<size_t>(infer)];
  }
  DTENSOR_CHECK(known == numel, "{}: shape {} is invalid for a DTensor of shape {} ({} elements)",
                info.name, info.arg(1).toIntVector(), in.shape, numel);
  return out;
}

// For each input dim, the output dim that starts its group (-1: none). Groups: input dims
// [i0, i) and output dims [o0, o) with equal products (size-1 dims map to nothing). The
// products match at the end (view_size checked it), so neither index runs past its end.
std::vector<int64_t> view_groups(const std::vector<int64_t>& in, const std::vector<int64_t>& out,
                                 int64_t numel) {
  const auto n = static_cast<int64_t>(in.size());
  std::vector<int64_t> m(static_cast<size_t>(n), -1);
  if (numel == 0) {
    // No element to keep in place: shards follow only an unchanged shape.
    return out == in ? identity(n) : m;
  }
  size_t i = 0;
  size_t o = 0;
  while (i < in.size() || o < out.size()) {
    if (i < in.size() && in[i] == 1) {
      ++i;
      continue;
    }
    if (o < out.size() && out[o] == 1) {
      ++o;
      continue;
    }
    if (i >= in.size() || o >= out.size()) {
      break;
    }
    size_t i0 = i;
    size_t o0 = o;
    int64_t pi = in[i++];
    int64_t po = out[o++];
    while (pi != po) {
      if (pi < po) {
        pi *= in[i++];
      } else {
        po *= out[o++];
      }
    }
    m[i0] = static_cast<int64_t>(o0);
  }
  return m;
}

// A shard of input dim d lands on output dim m[d] when its piece is the same on both sides:
// the group is that one dim on each side (same size: any cut, even uneven, is the same cut),
// or, for merged / split dims, every nested cut divides both sides evenly (checked in mesh
// order on the sizes the cuts before it leave). Other shards become Replicate.
void keep_even_cuts(const OpInfo& info, const DTensorSpec& in, const std::vector<int64_t>& out,
                    const std::vector<int64_t>& m, OpSharding& s) {
  std::vector<int64_t> cur_in = in.shape;
  std::vector<int64_t> cur_out = out;
  for (size_t k = 0; k < in.placements.size(); ++k) {
    const Placement& p = in.placements[k];
    if (!p.is_shard() || m[static_cast<size_t>(p.dim())] < 0) {
      continue;
    }
    auto d = static_cast<size_t>(p.dim());
    auto od = static_cast<size_t>(m[d]);
    if (in.shape[d] == out[od]) {
      continue;
    }
    int64_t size = info.mesh->size(static_cast<int64_t>(k));
    if (cur_in[d] % size == 0 && cur_out[od] % size == 0) {
      cur_in[d] /= size;
      cur_out[od] /= size;
    } else {
      (*s.inputs[0])[k] = Placement::replicate();
      s.outputs[0][k] = Placement::replicate();
    }
  }
}

OpSharding view_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  int64_t numel = 1;
  for (int64_t d : in.shape) {
    numel *= d;
  }
  const std::vector<int64_t> out = view_size(info, in, numel);
  const std::vector<int64_t> m = view_groups(in.shape, out, numel);
  OpSharding s = map_dims(info, m);
  keep_even_cuts(info, in, out, m, s);
  return s; // the size becomes this rank's piece of it: [Note: shape arguments]
}

// slice_backward(grad, input_sizes, dim, start, end, step) / select_backward(grad,
// input_sizes, dim, index): zeros of the input's (global) size with the gradient written in.
// Shards off `dim` follow; Partial(sum) passes (the op is linear); the size becomes local.
OpSharding slice_select_backward(const OpInfo& info) {
  const DTensorSpec& grad = *info.specs[0];
  std::vector<int64_t> input_sizes = info.arg(1).toIntVector();
  const auto out_ndim = static_cast<int64_t>(input_sizes.size());
  int64_t dim = wrap_dim(info.arg(2).toInt(), out_ndim);
  bool select = info.op->schema().name() == "aten::select_backward";
  Placements want = grad.placements;
  Placements out = grad.placements;
  for (size_t i = 0; i < want.size(); ++i) {
    const Placement& p = grad.placements[i];
    if (p.is_shard()) {
      int64_t od = select && p.dim() >= dim ? p.dim() + 1 : p.dim();
      if (od == dim) {
        want[i] = out[i] = Placement::replicate();
      } else {
        out[i] = Placement::shard(od);
      }
    } else if (p.is_partial() && !(p.reduce_op() == ReduceOp::Sum && !p.is_norm_partial())) {
      want[i] = out[i] = Placement::replicate();
    }
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = want;
  s.outputs.push_back(out); // input_sizes becomes local: [Note: shape arguments]
  return s;
}

} // namespace

void register_view_ops() {
  register_rule("aten::slice_backward", slice_select_backward);
  register_rule("aten::select_backward", slice_select_backward);
  register_rule("aten::t", transpose_rule);
  register_rule("aten::transpose", transpose_rule);
  register_rule("aten::permute", permute_rule);
  register_rule("aten::unsqueeze", unsqueeze_rule);
  register_rule("aten::squeeze", squeeze_rule);
  register_rule("aten::expand", expand_rule);
  register_rule("aten::slice", slice_rule);
  register_rule("aten::select", select_rule);
  register_rule("aten::view", view_rule);
  register_rule("aten::_unsafe_view", view_rule);
}

} // namespace dtensor::detail
