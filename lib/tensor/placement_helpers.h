#pragma once

// Placement arithmetic shared by the sharding rules, the handler, fully_shard and clipping:
// no op, rule or registry here (those are lib/tensor/ops/rule.h and registry.h).

#include <cstdint>
#include <vector>

#include <dtensor/dtensor_spec.h>

namespace dtensor::detail {

// A dim argument made non-negative for a tensor of `ndim` dims.
inline int64_t wrap_dim(int64_t d, int64_t ndim) {
  return d < 0 ? d + ndim : d;
}
// Replicate on every one of `mesh_ndim` mesh dims.
Placements replicate_all(int64_t mesh_ndim);
// `placements` for a tensor of `shape`: negative shard dims made non-negative, each checked
// against the shape (the error names `what`, the placements and the shape).
Placements normalize_placements(const Placements& placements, const std::vector<int64_t>& shape,
                                const char* what);
// `p` with Partial placements replaced by Replicate.
Placements without_partial(const Placements& p);
// `in`'s placements with every dim in `whole` gathered and Partial reduced (for ops that
// are not linear); shards on the other dims stay.
Placements keep_other_shards(const DTensorSpec& in, const std::vector<bool>& whole);
// This rank's local shape of a tensor of global `shape` laid out as `placements` on `mesh`.
std::vector<int64_t> local_shape_of(const DeviceMesh& mesh, const Placements& placements,
                                    const std::vector<int64_t>& shape);

} // namespace dtensor::detail
