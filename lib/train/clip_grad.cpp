// get_total_norm / clip_grads_with_norm_ / clip_grad_norm_ over DTensor gradients.
#include <dtensor/clip_grad.h>

#include <algorithm>
#include <cmath>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>
#include <dtensor/fully_shard.h>
#include <dtensor/process_group.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "mesh/rank_device.h"
#include "tensor/dtensor_impl.h"
#include "tensor/placement_helpers.h"
#include "tensor/redistribute/redistribute.h"
#include "train/mesh_union.h"

namespace dtensor {

namespace detail {

// [Note: one all-reduce per mesh dimension]
// Every gradient contributes a local partial norm: sum |x|^p of its local tensor (finite p),
// max / min |x| (inf / -inf), or its count of non-zeros (p = 0). The contributions of all
// gradients are combined locally into one fp32 scalar, which is then all-reduced once over
// each mesh dimension that some gradient is sharded over (sum, or max / min); over a
// dimension where every gradient is Replicate (HSDP's replicate dimension) every rank
// already holds the whole value, and nothing is sent. A gradient that is not sharded over a
// reduced mesh
// dimension (Replicate there) holds the same values on every rank of that dimension, so
// its sum-type contribution is divided by that dimension's size first: the all-reduce adds
// it back exactly once. Max and min need no scaling. Gradients on different meshes (slices
// of one init_device_mesh, e.g. (dp) and (tp, dp)) are placed on the root mesh's dimensions
// by name, and the reduction runs over the union of those dimensions: still one all-reduce
// per distinct dimension. Plain gradients next to DTensor ones count as replicated
// everywhere. Partial gradients are first reduced to Replicate (their norm is not a
// function of the partial values): one extra all-reduce each, documented.
// Work is linear in the number of gradients: one small local reduction each, one stack.

namespace {

enum class Combine { Sum, Max, Min };

Combine combine_of(double p) {
  if (std::isinf(p)) {
    return p > 0 ? Combine::Max : Combine::Min;
  }
  return Combine::Sum;
}

at::Tensor local_part(const at::Tensor& x, double p) {
  const Combine c = combine_of(p);
  if (x.numel() == 0) {
    return at::full({}, c == Combine::Min ? INFINITY : 0.0, x.options().dtype(at::kFloat));
  }
  at::Tensor a = x.detach().to(at::kFloat).abs();
  if (c == Combine::Max) {
    return a.max();
  }
  if (c == Combine::Min) {
    return a.min();
  }
  if (p == 0) {
    return (a != 0).sum().to(at::kFloat);
  }
  if (p == 1) {
    return a.sum();
  }
  if (p == 2) {
    return a.square().sum();
  }
  return a.pow(p).sum();
}

// One gradient's local partial norm (unscaled) and the union-mesh dims it is sharded over.
struct Contribution {
  at::Tensor part;
  std::vector<bool> sharded;
};

Contribution contribution(const at::Tensor& t, const MeshUnion& red, double p) {
  Contribution k;
  at::Tensor local = t;
  if (red.mesh.defined()) {
    k.sharded.assign(static_cast<size_t>(red.mesh.ndim()), false);
  }
  if (const DTensorMeta* m = dtensor_meta(t)) {
    local = m->local;
    Placements placements = m->spec.placements;
    const Placements plain = without_partial(placements);
    if (plain != placements) {
      local = redistribute_local(local, m->spec, plain);
      placements = plain;
    }
    const auto& map = red.map_of(m->spec.mesh);
    for (size_t d = 0; d < placements.size(); ++d) {
      k.sharded[static_cast<size_t>(map[d])] = placements[d].is_shard();
    }
  }
  k.part = local_part(local, p);
  return k;
}

std::vector<bool> dims_to_reduce(const std::vector<Contribution>& contribs, const MeshUnion& red) {
  std::vector<bool> reduced(red.mesh.defined() ? static_cast<size_t>(red.mesh.ndim()) : 0, false);
  for (const auto& k : contribs) {
    for (size_t d = 0; d < reduced.size(); ++d) {
      reduced[d] = reduced[d] || k.sharded[d];
    }
  }
  return reduced;
}

// A sum-type part of a gradient replicated over a reduced dim is divided by that dim's size:
// the all-reduce adds it back exactly once. Max and min need no scaling.
at::Tensor scaled(const Contribution& k, const MeshUnion& red, const std::vector<bool>& reduced,
                  Combine c) {
  if (c != Combine::Sum || !red.mesh.defined()) {
    return k.part;
  }
  double replicas = 1;
  for (int64_t d = 0; d < red.mesh.ndim(); ++d) {
    if (reduced[static_cast<size_t>(d)] && !k.sharded[static_cast<size_t>(d)]) {
      replicas *= static_cast<double>(red.mesh.size(d));
    }
  }
  return replicas == 1 ? k.part : k.part / replicas;
}

// The tensors' partial norm after its all-reduces, before the p-th root: the sum of p-th
// powers (finite p), max / min (inf / -inf), or the per-tensor vector (p = 0), on the union
// of `extra_meshes` and the tensors' meshes.
struct Reduced {
  at::Tensor acc;
  MeshUnion red;
  bool count_tensors = false;
};

Reduced reduce_partial(const std::vector<at::Tensor>& tensors,
                       const std::vector<DeviceMesh>& extra_meshes, double p) {
  std::vector<DeviceMesh> meshes = extra_meshes;
  for (const auto& t : tensors) {
    if (const DTensorMeta* m = dtensor_meta(t)) {
      meshes.push_back(m->spec.mesh);
    }
  }
  const MeshUnion red = mesh_union(meshes, "get_total_norm");
  const Combine c = combine_of(p);
  at::Device device = tensors.empty() ? at::Device(at::kCPU) : tensors.front().device();
  std::vector<Contribution> contribs;
  contribs.reserve(tensors.size());
  for (const auto& t : tensors) {
    contribs.push_back(contribution(t, red, p));
  }
  // Only mesh dims that some gradient is sharded over need the all-reduce: over the others
  // every gradient already holds the whole value on every rank.
  const std::vector<bool> reduced = dims_to_reduce(contribs, red);
  std::vector<at::Tensor> parts;
  parts.reserve(contribs.size());
  for (auto& k : contribs) {
    parts.push_back(scaled(k, red, reduced, c).to(device));
  }
  // [Note: the 0-"norm"]
  // PyTorch's total 0-norm is the 0-norm of the per-gradient norms: the number of
  // gradients with a non-zero element anywhere, not the number of non-zero elements. The
  // per-gradient counts are reduced as one vector (still one all-reduce per mesh dim);
  // every rank must then hold the same gradients, as the vector's length is theirs.
  const bool count_tensors = p == 0;
  at::Tensor acc;
  if (parts.empty()) {
    acc = count_tensors ? at::zeros({0}, at::TensorOptions().dtype(at::kFloat).device(device))
                        : at::full({}, c == Combine::Min ? INFINITY : 0.0,
                                   at::TensorOptions().dtype(at::kFloat).device(device));
  } else {
    at::Tensor all = at::stack(parts);
    acc = count_tensors       ? all
          : c == Combine::Max ? all.max()
          : c == Combine::Min ? all.min()
                              : all.sum();
  }
  if (red.mesh.defined()) {
    const ReduceOp op = c == Combine::Max   ? ReduceOp::Max
                        : c == Combine::Min ? ReduceOp::Min
                                            : ReduceOp::Sum;
    // On the mesh's device: the gradients of a CPU-offloaded unit are on the host while an
    // NCCL group moves cuda tensors only (seen on a GPU, docs/testing.md).
    acc = acc.to(detail::rank_device(red.mesh.device_type())).contiguous();
    for (int64_t d = 0; d < red.mesh.ndim(); ++d) {
      // A one-rank dimension holds its total already ([Note: one-rank mesh dimensions
      // communicate nothing], transitions.cpp).
      if (reduced[static_cast<size_t>(d)] && red.mesh.size(d) > 1) {
        dtensor::all_reduce_(acc, op, red.mesh.get_group(d), detail::known_sizes());
      }
    }
  }
  return {acc, red, count_tensors};
}

at::Tensor finish_norm(const Reduced& r, double p, bool error_if_nonfinite, size_t count,
                       c10::ScalarType dtype) {
  const Combine c = combine_of(p);
  const at::Tensor& acc = r.acc;
  const MeshUnion& red = r.red;
  const bool count_tensors = r.count_tensors;
  at::Tensor total = count_tensors         ? (acc != 0).sum().to(at::kFloat)
                     : (c == Combine::Sum) ? (p == 1 ? acc : acc.pow(1.0 / p))
                                           : acc;
  if (error_if_nonfinite) {
    DTENSOR_CHECK(total.isfinite().item<bool>(),
                  "get_total_norm: the total norm of order {} of {} gradients is non-finite ({}); "
                  "set error_if_nonfinite=false to go on",
                  p, count, total.item<double>());
  }
  total = total.to(dtype);
  if (!red.mesh.defined()) {
    return total;
  }
  // The shape given: the norm is agreed by construction ([Note: agreeing on sizes]).
  return DTensor::from_local(total, red.mesh, replicate_all(red.mesh.ndim()), total.sizes().vec());
}


// [Note: gradients on several roots] Experts under expert parallelism live on a mesh of their
// own root ((dp_replicate, efsdp, ep)), and units over a flattened dimension ((dp_replicate,
// dp_shard_cp)) on dimensions their root does not have: no union of the meshes' dimensions
// holds them. Their tensors are grouped by root (a mesh with a flattened dimension is a group
// of its own), each group's partial reduced as above (one all-reduce per dimension of the
// group's union that some tensor is sharded over), the groups' partials combined on every
// rank (sum of p-th powers, max, min; counts for p = 0), then one all-reduce over
// `pipeline`: torchtitan's _clip_grad_norm_with_ep with its pp all-reduce. The result is a
// plain tensor, the same on every rank; with one group of its root's own dimensions, a
// Replicate DTensor over the union including pp. Under a pipeline every rank takes this path
// (one stage may hold one root and the next two): its pp all-reduce is the last, after each
// stage's own, so that every stage contributes its whole partial.
struct NormGroup {
  DeviceMesh key; // undefined: plain tensors
  std::vector<at::Tensor> tensors;
  std::vector<DeviceMesh> meshes;
};

DeviceMesh group_key(const DeviceMesh& m) {
  const DeviceMesh root = m.root_mesh();
  for (const std::string& name : m.dim_names()) {
    const auto& names = root.dim_names();
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      return m;
    }
  }
  return root;
}

NormGroup& group_of(std::vector<NormGroup>& groups, const DeviceMesh& key) {
  for (NormGroup& g : groups) {
    if (g.key == key) {
      return g;
    }
  }
  groups.push_back({key, {}, {}});
  return groups.back();
}

std::vector<NormGroup> norm_groups(const std::vector<at::Tensor>& tensors,
                                   const std::vector<DeviceMesh>& extra_meshes) {
  std::vector<NormGroup> groups;
  for (const DeviceMesh& m : extra_meshes) {
    group_of(groups, group_key(m)).meshes.push_back(m);
  }
  for (const at::Tensor& t : tensors) {
    const DTensorMeta* m = dtensor_meta(t);
    group_of(groups, m != nullptr ? group_key(m->spec.mesh) : DeviceMesh()).tensors.push_back(t);
  }
  return groups;
}

// Whether the union cannot hold the meshes: several roots.
bool several_roots(const std::vector<NormGroup>& groups) {
  std::vector<DeviceMesh> keys;
  for (const NormGroup& g : groups) {
    if (g.key.defined()) {
      keys.push_back(g.key);
    }
  }
  if (keys.size() > 1) {
    for (const DeviceMesh& k : keys) {
      DTENSOR_CHECK(!k.dim_names().empty(),
                    "get_total_norm: gradients live on several meshes, and {} has no "
                    "dimension names to place it on the root mesh {}",
                    k.to_string(), keys.front().to_string());
    }
    return true;
  }
  return false;
}

// One group of the root's own dimensions: the total as a Replicate DTensor over the union of
// its meshes and the pipeline's (as one all-reduce per dimension of that union gives it).
at::Tensor as_replicate(const at::Tensor& total, const std::vector<NormGroup>& groups,
                        const DeviceMesh& pipeline) {
  if (groups.size() != 1 || (groups[0].key.defined() && groups[0].key != groups[0].key.root_mesh())) {
    return total;
  }
  std::vector<DeviceMesh> meshes = groups[0].meshes;
  for (const at::Tensor& t : groups[0].tensors) {
    if (const DTensorMeta* m = dtensor_meta(t)) {
      meshes.push_back(m->spec.mesh);
    }
  }
  if (pipeline.defined()) {
    meshes.push_back(pipeline);
  }
  const MeshUnion red = mesh_union(meshes, "get_total_norm");
  if (!red.mesh.defined()) {
    return total;
  }
  return DTensor::from_local(total, red.mesh, replicate_all(red.mesh.ndim()), total.sizes().vec());
}

at::Tensor total_norm_by_group(const std::vector<NormGroup>& groups, const DeviceMesh& pipeline,
                               double p, bool error_if_nonfinite, c10::ScalarType dtype) {
  DTENSOR_CHECK(!pipeline.defined() || pipeline.ndim() == 1,
                "get_total_norm: the pipeline mesh must be 1-D (mesh[\"pp\"]), got {}",
                pipeline.defined() ? pipeline.to_string() : "");
  DTENSOR_CHECK(p != 0 || !pipeline.defined(),
                "get_total_norm: norm_type 0 counts gradient tensors, which differ between "
                "pipeline stages; it is not supported with a pipeline mesh ({})",
                pipeline.defined() ? pipeline.to_string() : "");
  const Combine c = combine_of(p);
  at::Tensor acc;
  size_t count = 0;
  for (const NormGroup& g : groups) {
    const Reduced r = reduce_partial(g.tensors, g.meshes, p);
    const at::Tensor part = r.count_tensors ? (r.acc != 0).sum().to(at::kFloat) : r.acc;
    count += g.tensors.size();
    acc = !acc.defined()       ? part
          : c == Combine::Max ? at::maximum(acc, part.to(acc.device()))
          : c == Combine::Min ? at::minimum(acc, part.to(acc.device()))
                              : acc + part.to(acc.device());
  }
  if (pipeline.defined()) { // each pipeline rank holds other stages' gradients
    const ReduceOp op = c == Combine::Max   ? ReduceOp::Max
                        : c == Combine::Min ? ReduceOp::Min
                                            : ReduceOp::Sum;
    acc = acc.to(detail::rank_device(pipeline.device_type())).contiguous();
    if (pipeline.size() > 1) {
      dtensor::all_reduce_(acc, op, pipeline.get_group(0), detail::known_sizes());
    }
  }
  at::Tensor total = c == Combine::Sum && p != 0 && p != 1 ? acc.pow(1.0 / p) : acc;
  if (error_if_nonfinite) {
    DTENSOR_CHECK(total.isfinite().item<bool>(),
                  "get_total_norm: the total norm of order {} of {} gradients is non-finite ({}); "
                  "set error_if_nonfinite=false to go on",
                  p, count, total.item<double>());
  }
  return as_replicate(total.to(dtype), groups, pipeline);
}

at::Tensor total_norm(const std::vector<at::Tensor>& tensors,
                      const std::vector<DeviceMesh>& extra_meshes, const DeviceMesh& pipeline,
                      double p, bool error_if_nonfinite, c10::ScalarType dtype) {
  DTENSOR_CHECK(p >= 0 || std::isinf(p),
                "get_total_norm: norm_type must be > 0, 0, inf or -inf, got {}", p);
  // Under a pipeline every rank takes the grouped path, whatever its stages hold: the
  // all-reduce over pp comes after each stage's own, on every stage alike.
  const std::vector<NormGroup> groups = norm_groups(tensors, extra_meshes);
  if (pipeline.defined() || several_roots(groups)) {
    return total_norm_by_group(groups, pipeline, p, error_if_nonfinite, dtype);
  }
  return finish_norm(reduce_partial(tensors, extra_meshes, p), p, error_if_nonfinite,
                     tensors.size(), dtype);
}

} // namespace

} // namespace detail

at::Tensor get_total_norm(const std::vector<at::Tensor>& tensors, double norm_type,
                          bool error_if_nonfinite, const DeviceMesh& pipeline) {
  at::NoGradGuard no_grad;
  c10::ScalarType dtype = tensors.empty() ? at::kFloat : tensors.front().scalar_type();
  return detail::total_norm(tensors, {}, pipeline, norm_type, error_if_nonfinite, dtype);
}

void clip_grads_with_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           const at::Tensor& total_norm) {
  at::NoGradGuard no_grad;
  const detail::DTensorMeta* m = detail::dtensor_meta(total_norm);
  at::Tensor total = m != nullptr ? m->local : total_norm;
  at::Tensor coef = (max_norm / (total.to(at::kFloat) + 1e-6)).clamp_max(1.0);
  for (const auto& p : parameters) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) {
      continue;
    }
    if (const detail::DTensorMeta* gm = detail::dtensor_meta(g)) {
      gm->local.mul_(coef.to(gm->local.device()));
    } else {
      g.mul_(coef.to(g.device()));
    }
  }
}

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           double norm_type, bool error_if_nonfinite, const DeviceMesh& pipeline) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  std::vector<DeviceMesh> meshes; // every DTensor parameter's, so ranks without a gradient
                                  // still take part in the same all-reduces
  for (const auto& p : parameters) {
    if (p.grad().defined()) {
      grads.push_back(p.grad());
    }
    if (const detail::DTensorMeta* m = detail::dtensor_meta(p)) {
      meshes.push_back(m->spec.mesh);
    }
  }
  c10::ScalarType dtype = at::kFloat;
  if (grads.empty()) {
    TORCH_WARN("Called clip_grad_norm_() on rank ", get_rank(),
               " with no gradients -- returning the total norm in the default dtype torch.float32");
  } else {
    dtype = grads.front().scalar_type();
  }
  at::Tensor total =
      detail::total_norm(grads, meshes, pipeline, norm_type, error_if_nonfinite, dtype);
  clip_grads_with_norm_(parameters, max_norm, total);
  return total;
}

// fully_shard's member lives here, beside what it calls: lib/parallel/ sits below lib/train/
// and includes nothing of it (docs/architecture.md, "Layers (bottom up)").
at::Tensor FSDPModule::clip_grad_norm_(double max_norm, double norm_type, bool error_if_nonfinite) {
  DTENSOR_CHECK(is_root(),
                "clip_grad_norm_ should only be called on the root FSDP instance; unit '{}' is "
                "nested in another",
                name());
  return dtensor::clip_grad_norm_(parameters(), max_norm, norm_type, error_if_nonfinite);
}

} // namespace dtensor
