// The 1-D transitions and the executor. Each transition changes the placement of one mesh
// dimension; a communicating one issues exactly one collective through the choke point.
#include <ATen/ATen.h>

#include <cmath>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "tensor/redistribute/transitions.h"

namespace dtensor::detail {

namespace {

using Shape = std::vector<int64_t>;

int64_t coord(const DeviceMesh& mesh, int64_t dim) { return mesh.get_local_rank(dim); }

// Pads `t` along `dim` with zeros up to `size`.
at::Tensor pad_to(const at::Tensor& t, int64_t dim, int64_t size) {
  int64_t have = t.size(dim);
  if (have == size) {
    return t.contiguous();
  }
  auto shape = t.sizes().vec();
  shape[static_cast<size_t>(dim)] = size - have;
  return at::cat({t, at::zeros(shape, t.options())}, dim).contiguous();
}

ReduceOp partial_collective_op(const Placement& p) {
  if (!p.is_norm_partial()) {
    return p.reduce_op();
  }
  double q = p.norm_p();
  if (std::isinf(q)) {
    return q > 0 ? ReduceOp::Max : ReduceOp::Min;
  }
  return ReduceOp::Sum;
}

// --- anything on a one-rank mesh dimension: the local tensor already is the value ----------
// [Note: one-rank mesh dimensions communicate nothing] A group of one holds the whole of every
// placement: its shard is the full extent, its partial value the reduced one. PyTorch 2.15
// skips these steps too (counts match), rather than issuing the collective as a local copy.
bool relabel_ok(const Placement&, const Placement&, const Shape&, int64_t k) { return k == 1; }
at::Tensor relabel_apply(const at::Tensor& local, const TransformStep&, const DeviceMesh&) {
  return local;
}

// --- S(d) -> R: all-gather (each chunk padded to the largest, then trimmed) ---------------
bool gather_ok(const Placement& s, const Placement& d, const Shape&, int64_t) {
  return s.is_shard() && d.is_replicate();
}
at::Tensor gather_apply(const at::Tensor& local, const TransformStep& step, const DeviceMesh& mesh) {
  int64_t d = step.src.dim();
  int64_t k = mesh.size(step.mesh_dim);
  int64_t full = step.logical_shape[static_cast<size_t>(d)];
  int64_t padded = (full + k - 1) / k;
  at::Tensor gathered = dtensor::all_gather_tensor(
      pad_to(local, d, padded), d, mesh.get_group(step.mesh_dim), detail::known_sizes());
  return gathered.size(d) == full ? gathered : gathered.narrow(d, 0, full).contiguous();
}

// --- P -> R: all-reduce ----------------------------------------------------------------------
bool reduce_ok(const Placement& s, const Placement& d, const Shape&, int64_t) {
  return s.is_partial() && d.is_replicate();
}
at::Tensor reduce_apply(const at::Tensor& local, const TransformStep& step, const DeviceMesh& mesh) {
  const Placement& p = step.src;
  at::Tensor t = local.clone(at::MemoryFormat::Contiguous);
  double q = p.is_norm_partial() ? p.norm_p() : 1.0;
  bool powered = p.is_norm_partial() && !std::isinf(q) && q != 0.0 && q != 1.0;
  if (powered) {
    t = t.pow(q);
  }
  dtensor::all_reduce_(t, partial_collective_op(p), mesh.get_group(step.mesh_dim),
                       detail::known_sizes());
  return powered ? t.pow(1.0 / q) : t;
}

// --- P -> S(d): reduce-scatter (input padded to a multiple of the group size) -------------
bool reduce_scatter_ok(const Placement& s, const Placement& d, const Shape&, int64_t) {
  return s.is_partial() && !s.is_norm_partial() && d.is_shard();
}
at::Tensor reduce_scatter_apply(const at::Tensor& local, const TransformStep& step,
                                const DeviceMesh& mesh) {
  int64_t d = step.dst.dim();
  int64_t k = mesh.size(step.mesh_dim);
  int64_t full = step.logical_shape[static_cast<size_t>(d)];
  int64_t padded = (full + k - 1) / k;
  at::Tensor out =
      dtensor::reduce_scatter_tensor(pad_to(local, d, padded * k), step.src.reduce_op(), d,
                                     mesh.get_group(step.mesh_dim), detail::known_sizes());
  int64_t mine = chunk_size(full, k, coord(mesh, step.mesh_dim));
  return mine == padded ? out : out.narrow(d, 0, mine).contiguous();
}

// --- S(d) -> S(e): all-to-all (even sizes; uneven ones are routed through Replicate) ------
bool all_to_all_ok(const Placement& s, const Placement& d, const Shape& shape, int64_t k) {
  return s.is_shard() && d.is_shard() && s.dim() != d.dim() &&
         shape[static_cast<size_t>(s.dim())] % k == 0 && shape[static_cast<size_t>(d.dim())] % k == 0;
}
at::Tensor all_to_all_apply(const at::Tensor& local, const TransformStep& step, const DeviceMesh& mesh) {
  int64_t from = step.src.dim();
  int64_t to = step.dst.dim();
  int64_t k = mesh.size(step.mesh_dim);
  // Row j of `send` is the piece of our chunk that rank j keeps along `to`.
  at::Tensor send = at::stack(local.chunk(k, to), 0).contiguous();
  at::Tensor recv = dtensor::all_to_all_single(send, {}, {}, mesh.get_group(step.mesh_dim),
                                               detail::known_sizes());
  // Row j of `recv` is rank j's chunk along `from` of our piece: concatenate along `from`.
  return at::cat(recv.unbind(0), from).contiguous();
}

// --- R -> S(d): keep the local chunk, no communication --------------------------------------
bool chunk_ok(const Placement& s, const Placement& d, const Shape&, int64_t) {
  return s.is_replicate() && d.is_shard();
}
at::Tensor chunk_apply(const at::Tensor& local, const TransformStep& step, const DeviceMesh& mesh) {
  int64_t d = step.dst.dim();
  int64_t k = mesh.size(step.mesh_dim);
  int64_t c = coord(mesh, step.mesh_dim);
  int64_t full = local.size(d);
  return local.narrow(d, chunk_offset(full, k, c), chunk_size(full, k, c)).contiguous();
}

// --- R -> P: partition the value, no communication ------------------------------------------
bool partition_ok(const Placement& s, const Placement& d, const Shape&, int64_t) {
  return s.is_replicate() && d.is_partial();
}
at::Tensor partition_apply(const at::Tensor& local, const TransformStep& step, const DeviceMesh& mesh) {
  const Placement& p = step.dst;
  auto k = static_cast<double>(mesh.size(step.mesh_dim));
  if (p.is_norm_partial()) {
    double q = p.norm_p();
    if (std::isinf(q)) {
      return local.clone();
    }
    if (q == 0.0) { // a count of non-zeros: keep it on coordinate 0
      return coord(mesh, step.mesh_dim) == 0 ? local.clone() : at::zeros_like(local);
    }
    return local / std::pow(k, 1.0 / q);
  }
  switch (p.reduce_op()) {
  case ReduceOp::Sum:
    return local / k; // the conjugate of the sum: every rank holds an equal share
  case ReduceOp::Product:
    DTENSOR_FAIL("redistribute: Replicate() -> {} is not supported", p.to_string());
  default: // avg, max, min: every rank holds the value
    return local.clone();
  }
}

// --- S(d) -> P(sum): the shard at its offset in zeros of the full size, no communication ----
// [Note: shard to partial by zero-filling] The ranks' tensors then sum to the full value. Earlier
// dtensor went through Replicate (an all-gather, then a share of it per rank); PyTorch 2.15
// zero-fills too, so values, placements and counts (none) agree. Only a sum: zeros are not the
// identity of max or min, and an average would need the shard scaled by the group size.
bool zero_fill_ok(const Placement& s, const Placement& d, const Shape&, int64_t) {
  return s.is_shard() && d.is_partial() && !d.is_norm_partial() && d.reduce_op() == ReduceOp::Sum;
}
at::Tensor zero_fill_apply(const at::Tensor& local, const TransformStep& step, const DeviceMesh& mesh) {
  int64_t d = step.src.dim();
  int64_t k = mesh.size(step.mesh_dim);
  int64_t full = step.logical_shape[static_cast<size_t>(d)];
  auto shape = local.sizes().vec();
  shape[static_cast<size_t>(d)] = full;
  at::Tensor out = at::zeros(shape, local.options());
  out.narrow(d, chunk_offset(full, k, coord(mesh, step.mesh_dim)), local.size(d)).copy_(local);
  return out;
}

const Transition kTransitions[] = {
    {"relabel", false, relabel_ok, relabel_apply}, // first: it wins on one-rank dimensions
    {"all_gather", true, gather_ok, gather_apply},
    {"all_reduce", true, reduce_ok, reduce_apply},
    {"reduce_scatter", true, reduce_scatter_ok, reduce_scatter_apply},
    {"all_to_all", true, all_to_all_ok, all_to_all_apply},
    {"local_chunk", false, chunk_ok, chunk_apply},
    {"partition", false, partition_ok, partition_apply},
    {"zero_fill", false, zero_fill_ok, zero_fill_apply},
};

} // namespace

const Transition* suitable_transition(const Placement& src, const Placement& dst,
                                      const std::vector<int64_t>& shape, int64_t group_size) {
  for (const Transition& t : kTransitions) {
    if (t.suitable(src, dst, shape, group_size)) {
      return &t;
    }
  }
  return nullptr;
}

const Transition& find_transition(const TransformStep& step) {
  const Transition* t = suitable_transition(step.src, step.dst, step.logical_shape, step.group_size);
  DTENSOR_CHECK(t != nullptr, "redistribute: no transition from {} to {} on mesh dim {}",
                step.src.to_string(), step.dst.to_string(), step.mesh_dim);
  return *t;
}

std::vector<Placement> route_through_replicate(const Placement& src, const Placement& dst,
                                               const std::vector<int64_t>& logical_shape,
                                               int64_t group_size) {
  if (src == dst) {
    return {};
  }
  if (dst.is_replicate() || suitable_transition(src, dst, logical_shape, group_size) != nullptr) {
    return {dst};
  }
  return {Placement::replicate(), dst}; // e.g. Partial -> Partial, Shard -> Partial(max)
}

at::Tensor execute_redistribute(const at::Tensor& local, const DTensorSpec& src,
                                const std::vector<TransformStep>& plan) {
  at::Tensor t = local;
  for (const TransformStep& step : plan) {
    const Transition& via = step.transition != nullptr ? *step.transition : find_transition(step);
    t = via.apply(t, step, src.mesh);
  }
  return t;
}

} // namespace dtensor::detail
