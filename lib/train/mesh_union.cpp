// The union of several DTensors' meshes (see lib/train/mesh_union.h).
#include "train/mesh_union.h"

#include <algorithm>
#include <set>

#include "internal/check.h"

namespace dtensor::detail {

const std::vector<int64_t>& MeshUnion::map_of(const DeviceMesh& m) const {
  for (const auto& e : maps) {
    if (e.first == m) {
      return e.second;
    }
  }
  DTENSOR_FAIL("mesh union: internal error: no map for {}", m.to_string());
}

MeshUnion mesh_union(const std::vector<DeviceMesh>& meshes, const char* what) {
  MeshUnion r;
  std::vector<DeviceMesh> distinct;
  for (const auto& m : meshes) {
    if (std::find(distinct.begin(), distinct.end(), m) == distinct.end()) {
      distinct.push_back(m);
    }
  }
  if (distinct.empty()) {
    return r;
  }
  if (distinct.size() == 1) {
    r.mesh = distinct.front();
    std::vector<int64_t> identity;
    for (int64_t d = 0; d < r.mesh.ndim(); ++d) {
      identity.push_back(d);
    }
    r.maps.emplace_back(r.mesh, identity);
    return r;
  }
  // Several meshes: their dimensions by name on the root mesh.
  DeviceMesh root = distinct.front().root_mesh();
  const auto& root_names = root.dim_names();
  std::set<int64_t> used;
  std::vector<std::vector<int64_t>> root_dims;
  for (const auto& m : distinct) {
    DTENSOR_CHECK(!m.dim_names().empty(),
                  "{}: gradients live on several meshes, and {} has no "
                  "dimension names to place it on the root mesh {}",
                  what, m.to_string(), root.to_string());
    DTENSOR_CHECK(m.root_mesh() == root,
                  "{}: gradients live on meshes of different roots: {} and {}", what,
                  m.root_mesh().to_string(), root.to_string());
    std::vector<int64_t> dims;
    for (const auto& name : m.dim_names()) {
      auto it = std::find(root_names.begin(), root_names.end(), name);
      DTENSOR_CHECK(it != root_names.end(),
                    "{}: dimension '{}' of {} is not a dimension of the root "
                    "mesh {} (flattened dimensions are not supported across meshes)",
                    what, name, m.to_string(), root.to_string());
      dims.push_back(it - root_names.begin());
      used.insert(dims.back());
    }
    root_dims.push_back(dims);
  }
  std::vector<std::string> names;
  std::vector<int64_t> order(used.begin(), used.end()); // root order
  for (int64_t d : order) {
    names.push_back(root_names[static_cast<size_t>(d)]);
  }
  r.mesh = root[names];
  for (size_t i = 0; i < distinct.size(); ++i) {
    std::vector<int64_t> map;
    for (int64_t d : root_dims[i]) {
      map.push_back(std::find(order.begin(), order.end(), d) - order.begin());
    }
    r.maps.emplace_back(distinct[i], map);
  }
  return r;
}

} // namespace dtensor::detail
