// Redistribution costs as shortest paths of direct transitions ([Note: redistribution costs are
// a metric] in dtensor/collective_cost.h).
#include <dtensor/collective_cost.h>

#include <limits>

#include "internal/check.h"

namespace dtensor {

double direct_redistribute_seconds(const Placement& from, const Placement& to, int64_t bytes,
                                   const std::vector<int>& ranks, const ClusterSpec& cluster) {
  const auto cost = [&](CollectiveKind kind, int64_t b) {
    return collective_cost(kind, b, ranks, cluster).seconds;
  };
  if (from == to || from.is_replicate()) { // a local chunk or zero fill
    return 0.0;
  }
  if (from.is_shard()) {
    if (to.is_replicate()) {
      return cost(CollectiveKind::AllGather, bytes);
    }
    if (to.is_shard()) { // each rank's piece, re-cut
      return cost(CollectiveKind::AllToAll, bytes / static_cast<int64_t>(ranks.size()));
    }
    return std::numeric_limits<double>::infinity(); // Shard -> Partial: no direct way
  }
  // Partial
  if (to.is_replicate()) {
    return cost(CollectiveKind::AllReduce, bytes);
  }
  if (to.is_shard()) {
    return cost(CollectiveKind::ReduceScatter, bytes);
  }
  return 0.0; // another Partial of the same op is the same placement
}

RedistributeCost redistribute_cost(const Placement& from, const Placement& to, int64_t ndim,
                                   int64_t bytes, const std::vector<int>& ranks,
                                   const ClusterSpec& cluster) {
  DTENSOR_CHECK(
      ndim >= 1 && (!from.is_shard() || from.dim() < ndim) && (!to.is_shard() || to.dim() < ndim),
      "redistribute_cost: {} -> {} on a tensor of {} dims", from.to_string(), to.to_string(), ndim);
  // The placements (Replicate, from's Partial, Shard(0 .. ndim - 1)); Floyd-Warshall over them.
  std::vector<Placement> nodes = {Placement::replicate(), from.is_partial() ? from
                                                          : to.is_partial() ? to
                                                                            : Placement::partial()};
  for (int64_t d = 0; d < ndim; ++d) {
    nodes.push_back(Placement::shard(d));
  }
  const size_t n = nodes.size();
  std::vector<std::vector<double>> dist(n, std::vector<double>(n));
  std::vector<std::vector<size_t>> next(n, std::vector<size_t>(n));
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      dist[i][j] = direct_redistribute_seconds(nodes[i], nodes[j], bytes, ranks, cluster);
      next[i][j] = j;
    }
  }
  for (size_t k = 0; k < n; ++k) {
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < n; ++j) {
        if (dist[i][k] + dist[k][j] < dist[i][j]) {
          dist[i][j] = dist[i][k] + dist[k][j];
          next[i][j] = next[i][k];
        }
      }
    }
  }
  const auto index = [&](const Placement& p) {
    for (size_t i = 0; i < n; ++i) {
      if (nodes[i] == p) {
        return i;
      }
    }
    DTENSOR_CHECK(false, "redistribute_cost: placement {} not among the tensor's", p.to_string());
    return size_t{0};
  };
  size_t i = index(from);
  const size_t j = index(to);
  RedistributeCost out;
  out.seconds = dist[i][j];
  out.path.push_back(nodes[i]);
  while (i != j) {
    i = next[i][j];
    out.path.push_back(nodes[i]);
  }
  return out;
}

} // namespace dtensor
