#pragma once

// The union of the meshes that several DTensors live on, for reductions that combine them
// with one all-reduce per mesh dimension (clip_grad_norm_'s total norm, GradScaler's
// found-inf). See [Note: one all-reduce per mesh dimension] in lib/train/clip_grad.cpp.
#include <utility>
#include <vector>

#include <dtensor/device_mesh.h>

namespace dtensor::detail {

// One mesh: itself. Several slices of one root mesh (e.g. (dp) and (tp, dp)): the root's
// named dims they use, in root order, and for each mesh the index of each of its dims.
struct MeshUnion {
  DeviceMesh mesh; // undefined: no DTensor anywhere
  // For each mesh the tensors live on: its dim -> index into `mesh`'s dims.
  std::vector<std::pair<DeviceMesh, std::vector<int64_t>>> maps;

  const std::vector<int64_t>& map_of(const DeviceMesh& m) const;
};

// `what` names the caller in errors (meshes without dim names, different roots, dims that
// are not the root's).
MeshUnion mesh_union(const std::vector<DeviceMesh>& meshes, const char* what);

} // namespace dtensor::detail
