#pragma once

// The choke point's side of CommDebugMode (include/dtensor/comm_debug_mode.h): not for users.
#include <dtensor/comm_debug_mode.h>

namespace dtensor::detail {

// Whether any CommDebugMode is active on this thread (skip building records otherwise).
bool comm_debug_active();
// Adds `rec` to every CommDebugMode active on this thread.
void record_collective(const CollectiveRecord& rec);

} // namespace dtensor::detail
