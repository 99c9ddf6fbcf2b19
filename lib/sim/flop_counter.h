#pragma once

// The FLOP counter of StepRecorder ([Note: FLOPs] in flop_counter.cpp).
#include <cstdint>

namespace dtensor::detail {

// Starts counting on this thread (and the autograd threads it starts); returns a handle.
uint64_t start_counting_flops();
void stop_counting_flops(uint64_t handle);
// The FLOPs counted since the last call (as FlopCounterMode, and the kernels' work), and new
// counts from zero. While counting, collectives are stamped with the work so far.
struct CountedFlops {
  int64_t flops = 0;
  int64_t work = 0;
};
CountedFlops take_flops();

} // namespace dtensor::detail
