#pragma once

// Process-wide figures for long runs and soak tests (docs/reliability.md).
#include <cstddef>

namespace dtensor {

struct CacheSizes {
  size_t decisions = 0;     // sharding decisions cached by the dispatch handler
  size_t decisions_max = 0; // its bound (the cache starts over when it is reached)
  size_t plans = 0;         // redistribution plans cached by the planner
  size_t plans_max = 0;
};

// The sizes of dtensor's caches now.
CacheSizes cache_sizes();

} // namespace dtensor
