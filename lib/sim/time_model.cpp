// The time model: a step's predicted time from a rank's report ([Note: the time model] in
// dtensor/simulate.h).
#include <dtensor/simulate.h>

#include <algorithm>

#include "internal/check.h"

namespace dtensor {

namespace {

bool within_one_node(const std::vector<int>& ranks, int64_t per_node) {
  for (int r : ranks) {
    if (r / per_node != ranks.front() / per_node) {
      return false;
    }
  }
  return true;
}

} // namespace

double collective_seconds(const CollectiveRecord& c, const TimeModelOptions& o) {
  DTENSOR_CHECK(o.ranks_per_node() > 0 && o.intra_node_gbps() > 0 && o.inter_node_gbps() > 0,
                "TimeModelOptions: ranks per node ({}) and bandwidths ({}, {} GB/s) must be "
                "positive",
                o.ranks_per_node(), o.intra_node_gbps(), o.inter_node_gbps());
  const auto k = static_cast<double>(c.ranks.size());
  if (k <= 1) {
    return 0.0;
  }
  const bool local = within_one_node(c.ranks, o.ranks_per_node());
  const double bw = (local ? o.intra_node_gbps() : o.inter_node_gbps()) * 1e9;
  const double alpha = (local ? o.intra_node_latency_us() : o.inter_node_latency_us()) * 1e-6;
  const double ring = (k - 1) / k;
  switch (c.kind) {
    case CollectiveKind::AllGather:
      return (k - 1) * alpha + ring * static_cast<double>(c.bytes_out) / bw;
    case CollectiveKind::ReduceScatter:
    case CollectiveKind::AllToAll:
      return (k - 1) * alpha + ring * static_cast<double>(c.bytes_in) / bw;
    case CollectiveKind::AllReduce:
      return 2 * ((k - 1) * alpha + ring * static_cast<double>(c.bytes_in) / bw);
    case CollectiveKind::Broadcast:
      return alpha + static_cast<double>(c.bytes_in) / bw;
    case CollectiveKind::Barrier:
      return (k - 1) * alpha;
    case CollectiveKind::Send: // one link, one way
      return alpha + static_cast<double>(c.bytes_in) / bw;
    case CollectiveKind::Recv:
      return alpha + static_cast<double>(c.bytes_out) / bw;
  }
  return 0.0;
}

StepTime predict_step_time(const RankReport& report, const TimeModelOptions& o) {
  DTENSOR_CHECK(o.achieved_tflops() > 0, "TimeModelOptions: achieved_tflops must be positive, got {}",
                o.achieved_tflops());
  StepTime t;
  for (const auto& p : report.phases) {
    PhaseTime pt;
    pt.name = p.name;
    pt.compute_s = static_cast<double>(p.flops) / (o.achieved_tflops() * 1e12);
    for (const auto& c : p.collectives) {
      (c.async ? pt.async_comm_s : pt.sync_comm_s) += collective_seconds(c, o);
    }
    pt.total_s = pt.compute_s + pt.sync_comm_s + std::max(0.0, pt.async_comm_s - pt.compute_s);
    t.total_s += pt.total_s;
    t.phases.push_back(pt);
  }
  if (report.tokens > 0 && t.total_s > 0) {
    t.tokens_per_second_per_rank =
        static_cast<double>(report.tokens) / report.world_size / t.total_s;
  }
  return t;
}

} // namespace dtensor
