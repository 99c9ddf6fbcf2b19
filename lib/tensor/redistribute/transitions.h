#pragma once

// The 1-D transitions of redistribution: one small function per (source -> target) kind,
// picked from one ordered registry (transitions.cpp).

#include <vector>

#include "tensor/redistribute/redistribute.h"

namespace dtensor::detail {

struct Transition {
  const char* name;
  bool communicates;
  bool (*suitable)(const Placement& src, const Placement& dst, const std::vector<int64_t>& shape,
                   int64_t group_size);
  at::Tensor (*apply)(const at::Tensor& local, const TransformStep& step, const DeviceMesh& mesh);
};

// The first registered transition suitable for src -> dst (nullptr: none).
const Transition* suitable_transition(const Placement& src, const Placement& dst,
                                      const std::vector<int64_t>& shape, int64_t group_size);
// The first registered transition suitable for `step`; throws naming the step otherwise.
const Transition& find_transition(const TransformStep& step);

// The placements a mesh dimension passes through to go from `src` to `dst` (the last one
// is `dst`): one entry when a registered transition does it, else via Replicate.
std::vector<Placement> route_through_replicate(const Placement& src, const Placement& dst,
                                               const std::vector<int64_t>& logical_shape,
                                               int64_t group_size);

} // namespace dtensor::detail
