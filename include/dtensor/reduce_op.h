#pragma once

// The reduce operations and collective kinds that placements, collectives and
// CommDebugMode share (kept apart so that placement.h needs nothing of collectives.h).
#include <string>

namespace dtensor {

enum class ReduceOp { Sum, Avg, Max, Min, Product };
std::string to_string(ReduceOp op);

// Send and Recv are point-to-point (pipeline stages); PyTorch's CommDebugMode does not count
// them, dtensor's does.
enum class CollectiveKind { AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Barrier, Send, Recv };
constexpr int kNumCollectiveKinds = 8;
std::string to_string(CollectiveKind kind);

} // namespace dtensor
