#pragma once

// The FLOP counter of StepRecorder ([Note: FLOPs] in flop_counter.cpp).
#include <cstdint>

namespace dtensor::detail {

// Starts counting on this thread (and the autograd threads it starts); returns a handle.
uint64_t start_counting_flops();
void stop_counting_flops(uint64_t handle);
// The FLOPs counted since the last call, and a new count from zero.
int64_t take_flops();

} // namespace dtensor::detail
