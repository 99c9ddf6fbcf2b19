// What travels between pipeline stages (activations.h).
//
// [Note: DTensor activations]
// A stage whose output is a DTensor (sequence-parallel hidden states between tensor-parallel
// blocks) sends its local tensor, never the global one: each tensor-parallel rank of the
// sending stage sends its shard to the rank of the same tensor-parallel coordinate in the
// next stage. The first step's shape exchange carries the placements and global sizes with
// the local sizes; the receiving stage rebuilds the DTensor on its own mesh
// (PipelineStage::mesh, the mesh its tensor parallelism runs on), without communication. The
// input gradient goes back the same way, first redistributed to the activation's placements
// (a gradient may arrive Partial); the sending stage rebuilds it with its output's layout.
#include "parallel/pipelining/activations.h"

#include <ATen/ATen.h>

#include <dtensor/dtensor.h>

#include "internal/check.h"

namespace dtensor::detail {

namespace {

constexpr int64_t kMaxDims = 8;
constexpr int64_t kMaxMeshDims = 8;
// [0] ndim, [1] dtype, [2] dtensor, [3] placements, [4, 12) local sizes, [12, 20) global
// sizes, [20, 36) placements as (kind, argument) pairs.
constexpr int64_t kLocalAt = 4;
constexpr int64_t kGlobalAt = kLocalAt + kMaxDims;
constexpr int64_t kPlacementsAt = kGlobalAt + kMaxDims;
static_assert(kPlacementsAt + 2 * kMaxMeshDims <= kShapeMetaLen);

std::pair<int64_t, int64_t> encode_placement(const Placement& p) {
  if (p.is_shard()) {
    return {1, p.dim()};
  }
  DTENSOR_CHECK(p.is_replicate() || (p.is_partial() && !p.is_norm_partial()),
                "pipeline: a stage's activation has placement {}, which cannot travel between "
                "stages; redistribute it to Shard or Replicate in the stage",
                p.to_string());
  return p.is_replicate() ? std::pair<int64_t, int64_t>{0, 0}
                          : std::pair<int64_t, int64_t>{2, static_cast<int64_t>(p.reduce_op())};
}

Placement decode_placement(int64_t kind, int64_t arg) {
  if (kind == 1) {
    return Placement::shard(arg);
  }
  return kind == 0 ? Placement::replicate() : Placement::partial(static_cast<ReduceOp>(arg));
}

} // namespace

std::string StageShape::str() const {
  const std::string local = fmt::format("{}{}", c10::toString(dtype), sizes);
  if (!dtensor) {
    return local;
  }
  return fmt::format("DTensor {}{} {}, local {}", c10::toString(dtype), global,
                     dtensor::to_string(placements), sizes);
}

StageShape shape_of(const at::Tensor& t) {
  StageShape s;
  s.dtype = t.scalar_type();
  if (is_dtensor(t)) {
    const DTensor d(t);
    s.dtensor = true;
    s.global = t.sizes().vec();
    s.placements = d.placements();
    s.sizes = d.to_local().sizes().vec();
  } else {
    s.sizes = t.sizes().vec();
  }
  return s;
}

at::Tensor encode_shape(const StageShape& s) {
  DTENSOR_CHECK(static_cast<int64_t>(s.sizes.size()) <= kMaxDims &&
                    static_cast<int64_t>(s.placements.size()) <= kMaxMeshDims,
                "pipeline: a stage's tensors may have at most {} dimensions on meshes of at most "
                "{}, got {}",
                kMaxDims, kMaxMeshDims, s.str());
  at::Tensor t = at::zeros({kShapeMetaLen}, at::kLong);
  auto v = t.accessor<int64_t, 1>();
  v[0] = static_cast<int64_t>(s.sizes.size());
  v[1] = static_cast<int64_t>(s.dtype);
  v[2] = s.dtensor ? 1 : 0;
  v[3] = static_cast<int64_t>(s.placements.size());
  for (size_t i = 0; i < s.sizes.size(); ++i) {
    v[kLocalAt + static_cast<int64_t>(i)] = s.sizes[i];
    v[kGlobalAt + static_cast<int64_t>(i)] = s.dtensor ? s.global[i] : 0;
  }
  for (size_t i = 0; i < s.placements.size(); ++i) {
    const auto [kind, arg] = encode_placement(s.placements[i]);
    v[kPlacementsAt + 2 * static_cast<int64_t>(i)] = kind;
    v[kPlacementsAt + 2 * static_cast<int64_t>(i) + 1] = arg;
  }
  return t.to(shape_message_device());
}

c10::Device shape_message_device() {
  return is_simulated() ? c10::Device(c10::kCPU) : default_device();
}

StageShape decode_shape(const at::Tensor& wire) {
  StageShape s;
  const at::Tensor t = wire.cpu();
  auto v = t.accessor<int64_t, 1>();
  s.dtype = static_cast<at::ScalarType>(v[1]);
  s.dtensor = v[2] != 0;
  for (int64_t i = 0; i < v[0]; ++i) {
    s.sizes.push_back(v[kLocalAt + i]);
    if (s.dtensor) {
      s.global.push_back(v[kGlobalAt + i]);
    }
  }
  for (int64_t i = 0; i < v[3]; ++i) {
    s.placements.push_back(
        decode_placement(v[kPlacementsAt + 2 * i], v[kPlacementsAt + 2 * i + 1]));
  }
  return s;
}

at::Tensor wire_of(const at::Tensor& t) {
  at::Tensor local = is_dtensor(t) ? DTensor(t).to_local() : t;
  return local.detach().contiguous();
}

at::Tensor from_wire(const at::Tensor& local, const StageShape& s, const DeviceMesh& mesh,
                     const std::string& who) {
  if (!s.dtensor) {
    return local;
  }
  DTENSOR_CHECK(mesh.defined() && mesh.ndim() == static_cast<int64_t>(s.placements.size()),
                "pipeline: {} receives a DTensor ({}) but {}; set PipelineStage::mesh to the "
                "mesh its tensor parallelism runs on",
                who, s.str(),
                mesh.defined()
                    ? fmt::format("its mesh {} has {} dimensions", mesh.to_string(), mesh.ndim())
                    : std::string("has no mesh"));
  return DTensor::from_local(local, mesh, s.placements, s.global);
}

at::Tensor as_grad_of(const at::Tensor& grad, const StageShape& s) {
  if (!s.dtensor || !is_dtensor(grad)) {
    return grad;
  }
  const DTensor g(grad);
  return g.placements() == s.placements ? grad : at::Tensor(g.redistribute(s.placements));
}

at::Tensor grad_to_wire(const at::Tensor& grad, const StageShape& s) {
  return wire_of(as_grad_of(grad, s));
}

DeviceMesh mesh_of(const at::Tensor& t) {
  return is_dtensor(t) ? DTensor(t).device_mesh() : DeviceMesh();
}

} // namespace dtensor::detail
