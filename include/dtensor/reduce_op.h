#pragma once

// The reduce operations and collective kinds that placements, collectives and
// CommDebugMode share (kept apart so that placement.h needs nothing of collectives.h).
#include <string>

namespace dtensor {

enum class ReduceOp { Sum, Avg, Max, Min, Product };
std::string to_string(ReduceOp op);

enum class CollectiveKind { AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Barrier };
constexpr int kNumCollectiveKinds = 6;
std::string to_string(CollectiveKind kind);

} // namespace dtensor
