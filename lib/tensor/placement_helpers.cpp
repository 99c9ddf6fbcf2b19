// Placement arithmetic shared by the rules, the handler, fully_shard and clipping.
#include "tensor/placement_helpers.h"

#include "internal/check.h"

namespace dtensor::detail {

Placements replicate_all(int64_t mesh_ndim) {
  return Placements(static_cast<size_t>(mesh_ndim), Placement::replicate());
}

Placements normalize_placements(const Placements& placements, const std::vector<int64_t>& shape,
                                const char* what) {
  const auto ndim = static_cast<int64_t>(shape.size());
  Placements out;
  for (const auto& p : placements) {
    DTENSOR_CHECK(!p.is_shard() || (p.dim() >= -ndim && p.dim() < ndim),
                  "{}: placement {} in {} is out of range for a tensor of shape {}", what,
                  p.to_string(), to_string(placements), shape);
    out.push_back(p.normalized(ndim));
  }
  return out;
}

Placements keep_other_shards(const DTensorSpec& in, const std::vector<bool>& whole) {
  Placements want = in.placements;
  for (auto& p : want) {
    if (p.is_partial() || (p.is_shard() && whole[static_cast<size_t>(p.dim())])) {
      p = Placement::replicate();
    }
  }
  return want;
}

Placements without_partial(const Placements& p) {
  Placements out;
  for (const auto& x : p) {
    out.push_back(x.is_partial() ? Placement::replicate() : x);
  }
  return out;
}

std::vector<int64_t> local_shape_of(const DeviceMesh& mesh, const Placements& placements,
                                    const std::vector<int64_t>& shape) {
  DTensorSpec spec;
  spec.mesh = mesh;
  spec.placements = placements;
  spec.shape = shape;
  return spec.local_shape();
}

} // namespace dtensor::detail
