#pragma once

// Where a DTensor random op's key and offset come from ([Note: layout-independent random
// numbers]): dtensor's own state after dtensor::manual_seed, else the default (or given)
// CPU generator.

#include <optional>

#include <ATen/core/Generator.h>

#include "tensor/random/sample.h"

namespace dtensor::detail {

// The draw of the next random op; advances the state it came from. `generator`: the op's
// Generator argument, if any (a CPU generator).
Draw next_draw(const std::optional<at::Generator>& generator, const char* op_name);

// `box` placed in the global batch of this thread's BatchShardGuard, if one is alive:
// dim 0 scaled by the slice count and offset by the slice index ([Note: batch slices]).
Box in_global_batch(const Box& box);

} // namespace dtensor::detail
