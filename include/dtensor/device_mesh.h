#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <c10/core/DeviceType.h>

#include <dtensor/process_group.h>

namespace dtensor {

// [Note: DeviceMesh]
// An N-D array of global ranks with optional dimension names. Each process holds the groups
// of its own slices: for dimension d, the ranks that share its coordinates on every other
// dimension. Groups are created once (collectively, when the mesh is made) and cached by
// rank list, so sub-meshes and flattened meshes over the same ranks reuse them.
// PyTorch's init_device_mesh(..., backend_override=...): a dimension's backend and timeout,
// keyed by its name or index ([Note: per-group backends] in process_group.h). Dimensions
// not named take the default: the world's backend where it serves the mesh's device type,
// Gloo for a CPU mesh in an NCCL world.
using MeshDim = std::variant<int64_t, std::string>;
using BackendOverride = std::map<MeshDim, GroupOptions>;
struct DeviceMeshOptions {
  TORCH_ARG(BackendOverride, backend_override) = {};
};

class DeviceMesh {
 public:
  DeviceMesh() = default;
  // [Note: meshes on existing groups] PyTorch's DeviceMesh.from_group: a mesh whose
  // dimension groups are groups the caller already has (wrap_group() for c10d
  // communicators it created; new_group() ones too). One group: a 1-D mesh over the group's
  // ranks. One group per dimension: `shape` and `ranks` (row-major, global ranks) give the
  // layout, and each group must be this rank's slice of it along its dimension (checked:
  // the error names the dimension, the expected and the given ranks). No collective and no
  // new communicator, except later flatten() or slices across dimensions, which create
  // theirs with new_group (collective over their ranks, as for init_device_mesh meshes).
  static DeviceMesh from_group(const Group& group, c10::DeviceType device_type,
                               const std::vector<std::string>& dim_names = {});
  static DeviceMesh from_group(const std::vector<Group>& groups, c10::DeviceType device_type,
                               const std::vector<int64_t>& shape, const std::vector<int>& ranks,
                               const std::vector<std::string>& dim_names = {});

  c10::DeviceType device_type() const;
  const std::vector<int64_t>& shape() const;
  int64_t ndim() const;
  int64_t size() const; // number of ranks in the mesh
  int64_t size(int64_t dim) const;
  const std::vector<std::string>& dim_names() const; // empty when the mesh is unnamed
  // Index of a named dimension; throws naming the mesh when unknown.
  int64_t dim_index(const std::string& name) const;

  // This rank's global rank, and its coordinate on each dimension (nullopt when the rank
  // is not part of the mesh, which cannot happen for meshes made by init_device_mesh).
  int get_rank() const;
  std::optional<std::vector<int64_t>> get_coordinate() const;
  int64_t get_local_rank(int64_t dim) const;
  int64_t get_local_rank(const std::string& dim) const;

  // The group of this rank's slice along a dimension. Its label is the dimension's name
  // (or "dim<i>" for unnamed meshes; the group's own label on an unnamed from_group mesh),
  // which CommDebugMode reports.
  Group get_group(int64_t dim) const;
  Group get_group(const std::string& dim) const;
  Group get_group() const; // 1-D meshes only
  std::vector<Group> get_all_groups() const;

  // The global ranks of the mesh, row-major over shape().
  const std::vector<int>& ranks() const;

  // Sub-mesh over the named dimensions (in the given order; other dimensions fixed at this
  // rank's coordinates). Names made by flatten() on any ancestor mesh are accepted too.
  DeviceMesh operator[](const std::string& name) const;
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  DeviceMesh operator[](std::initializer_list<std::string> names) const {
    return (*this)[std::vector<std::string>(names)];
  }

  // A 1-D mesh over all ranks of this mesh (row-major), named `name` (default: dimension
  // names joined by '_'). The root mesh remembers it, so root[name] returns it afterwards.
  // Collective: every rank of the root mesh must call it.
  DeviceMesh flatten(const std::string& name = "") const;
  // The mesh init_device_mesh made, of which this one is a slice (itself when it is one):
  // combines sibling slices, e.g. mesh["dp"].root_mesh()[{"tp", "dp"}].
  DeviceMesh root_mesh() const;

  bool operator==(const DeviceMesh& other) const;
  bool operator!=(const DeviceMesh& other) const { return !(*this == other); }
  size_t hash() const;
  std::string to_string() const; // "DeviceMesh(cpu, [[0, 1], [2, 3]], names=(dp, tp))"
  bool defined() const { return state_ != nullptr; }

  struct State; // what a mesh is inside the library (lib/mesh/device_mesh.cpp)

 private:
  friend DeviceMesh init_device_mesh(c10::DeviceType, const std::vector<int64_t>&,
                                     const std::vector<std::string>&, const DeviceMeshOptions&);
  explicit DeviceMesh(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

// A mesh over all ranks of the world, ranks laid out row-major over `shape`. Collective:
// every rank calls it with the same arguments. Starts the process group if needed.
DeviceMesh init_device_mesh(c10::DeviceType device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names = {});
// With per-dimension backends (DeviceMeshOptions::backend_override).
DeviceMesh init_device_mesh(c10::DeviceType device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names,
                            const DeviceMeshOptions& options);

} // namespace dtensor

template <>
struct std::hash<dtensor::DeviceMesh> {
  size_t operator()(const dtensor::DeviceMesh& mesh) const { return mesh.hash(); }
};
