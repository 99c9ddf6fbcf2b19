// DTensorSpec: local shapes and offsets of nested shards, printing, equality.
#include <dtensor/dtensor_spec.h>

#include "internal/check.h"

namespace dtensor {

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> stride(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) {
    stride[d - 1] = stride[d] * std::max<int64_t>(shape[d], 1);
  }
  return stride;
}

bool DTensorSpec::has_partial() const {
  for (const auto& p : placements) {
    if (p.is_partial()) {
      return true;
    }
  }
  return false;
}

std::vector<int64_t> DTensorSpec::local_shape(const std::vector<int64_t>& coordinate) const {
  std::vector<int64_t> local = shape;
  for (size_t i = 0; i < placements.size(); ++i) {
    if (placements[i].is_shard()) {
      auto d = static_cast<size_t>(placements[i].dim());
      local[d] = chunk_size(local[d], mesh.size(static_cast<int64_t>(i)), coordinate[i]);
    }
  }
  return local;
}

std::vector<int64_t> DTensorSpec::local_offset(const std::vector<int64_t>& coordinate) const {
  std::vector<int64_t> local = shape;
  std::vector<int64_t> offset(shape.size(), 0);
  for (size_t i = 0; i < placements.size(); ++i) {
    if (placements[i].is_shard()) {
      auto d = static_cast<size_t>(placements[i].dim());
      int64_t k = mesh.size(static_cast<int64_t>(i));
      offset[d] += chunk_offset(local[d], k, coordinate[i]);
      local[d] = chunk_size(local[d], k, coordinate[i]);
    }
  }
  return offset;
}

std::vector<int64_t> DTensorSpec::local_shape() const { return local_shape(*mesh.get_coordinate()); }

std::vector<int64_t> DTensorSpec::local_offset() const {
  return local_offset(*mesh.get_coordinate());
}

std::string DTensorSpec::to_string() const {
  return fmt::format("DTensorSpec({}{}, {}, {})", c10::toString(dtype), shape,
                     dtensor::to_string(placements), mesh.to_string());
}

bool DTensorSpec::operator==(const DTensorSpec& other) const {
  return placements == other.placements && shape == other.shape && stride == other.stride &&
         dtype == other.dtype && mesh == other.mesh;
}

size_t DTensorSpec::hash() const {
  size_t h = mesh.hash();
  for (const auto& p : placements) {
    h = h * 31 + p.hash();
  }
  for (int64_t s : shape) {
    h = h * 31 + std::hash<int64_t>()(s);
  }
  for (int64_t s : stride) {
    h = h * 31 + std::hash<int64_t>()(s);
  }
  return h * 31 + static_cast<size_t>(dtype);
}

} // namespace dtensor
