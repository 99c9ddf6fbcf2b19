#pragma once

#include <utility>

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

// This thread's batch slice ([Note: batch slices]): (count, index); (1, 0) without a
// BatchShardGuard. Activation checkpointing's recompute runs under the forward's.
std::pair<int64_t, int64_t> current_batch_slice();

} // namespace dtensor::detail
