#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include <dtensor/device_mesh.h>
#include <dtensor/placement.h>

namespace dtensor {

// Everything that describes a DTensor except its local data: the mesh, one placement per
// mesh dimension, and the global shape, stride and dtype.
struct DTensorSpec {
  DeviceMesh mesh;
  Placements placements;
  std::vector<int64_t> shape;  // global
  std::vector<int64_t> stride; // global (contiguous unless given)
  c10::ScalarType dtype = c10::ScalarType::Float;

  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
  bool has_partial() const;
  // The shape of this rank's local tensor and its offset in the global tensor. Shards on the
  // same tensor dimension nest left to right over the mesh dimensions.
  std::vector<int64_t> local_shape() const;
  std::vector<int64_t> local_offset() const;
  // The same for an arbitrary coordinate of the mesh.
  std::vector<int64_t> local_shape(const std::vector<int64_t>& coordinate) const;
  std::vector<int64_t> local_offset(const std::vector<int64_t>& coordinate) const;
  std::string to_string() const; // "DTensorSpec(Float[8, 4], (Shard(0), Replicate()), DeviceMesh(...))"

  bool operator==(const DTensorSpec& other) const;
  bool operator!=(const DTensorSpec& other) const { return !(*this == other); }
  size_t hash() const;
};

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);

} // namespace dtensor
