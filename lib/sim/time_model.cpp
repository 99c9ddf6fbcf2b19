// The time model: a step's predicted time from a rank's report ([Note: the time model] in
// dtensor/simulate.h).
#include <dtensor/simulate.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>

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
  DTENSOR_CHECK(o.ranks_per_node() > 0 && o.intra_node_gbps() > 0 && o.inter_node_gbps() > 0 &&
                    o.p2p_gbps() >= 0,
                "TimeModelOptions: ranks per node ({}) and bandwidths ({}, {} GB/s) must be "
                "positive, p2p_gbps ({}) at least 0",
                o.ranks_per_node(), o.intra_node_gbps(), o.inter_node_gbps(), o.p2p_gbps());
  const auto k = static_cast<double>(c.ranks.size());
  if (k <= 1) {
    return 0.0;
  }
  if (o.cluster()) { // NCCL's size: all-gather's output, the input of the others
    const int64_t bytes = c.kind == CollectiveKind::AllGather ? c.bytes_out : c.bytes_in;
    return collective_cost(c.kind, bytes, c.ranks, *o.cluster()).seconds;
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
      return alpha + static_cast<double>(c.bytes_in) / (o.p2p_gbps() > 0 ? o.p2p_gbps() * 1e9 : bw);
    case CollectiveKind::Recv: // full duplex: the bytes are the sender's time
      return alpha;
  }
  return 0.0;
}

namespace {

// A phase on a timeline ([Note: the time model]): compute advances between issue points,
// each group's collectives queue on that group's stream.
class Timeline {
 public:
  explicit Timeline(const TimeModelOptions& o) : o_(o), rate_(o.achieved_tflops() * 1e12) {}

  void issue(const CollectiveRecord& c, PhaseTime& pt) {
    wait_until(c.issued_at);
    advance_to(c.issued_at);
    const double seconds = collective_seconds(c, o_);
    // Its wait recorded ([Note: waits on the timeline]): compute waits there. Else at the
    // next collective of its kind in its group.
    const bool waited = c.async && c.waited_at >= 0;
    Pending& last = pending_[{c.group, kind_class(c.kind)}];
    if (!waited && last.issued_at < c.issued_at) { // the batch before is waited for here
      clock_ = std::max(clock_, last.done);
      last = Pending{};
    }
    double& stream = stream_free_[c.group];
    const double done = std::max(clock_, stream) + seconds;
    stream = done;
    if (waited) {
      pt.async_comm_s += seconds;
      waits_.emplace(c.waited_at, done);
    } else if (c.async) {
      pt.async_comm_s += seconds;
      last.issued_at = c.issued_at;
      last.done = std::max(last.done, done);
    } else {
      pt.sync_comm_s += seconds;
      clock_ = done;
    }
  }

  double finish(int64_t work) {
    wait_until(work);
    advance_to(work);
    double end = clock_;
    for (const auto& [group, free] : stream_free_) {
      end = std::max(end, free);
    }
    return end;
  }

 private:
  struct Pending {
    int64_t issued_at = -1;
    double done = 0;
  };

  // Sends and receives are one kind: a ring step posts both, the next step waits for both.
  static int kind_class(CollectiveKind k) {
    return k == CollectiveKind::Recv ? static_cast<int>(CollectiveKind::Send)
                                     : static_cast<int>(k);
  }

  // The recorded waits up to work `at`, in order; a wait at an issue point comes first.
  void wait_until(int64_t at) {
    while (!waits_.empty() && waits_.begin()->first <= at) {
      advance_to(waits_.begin()->first);
      clock_ = std::max(clock_, waits_.begin()->second);
      waits_.erase(waits_.begin());
    }
  }

  void advance_to(int64_t at) {
    if (at > at_) {
      clock_ += static_cast<double>(at - at_) / rate_;
      at_ = at;
    }
  }

  const TimeModelOptions& o_;
  const double rate_;
  double clock_ = 0; // seconds since the phase began, on the compute stream
  int64_t at_ = 0;   // work FLOPs done by then
  std::map<std::pair<std::string, int>, Pending> pending_;
  std::map<std::string, double> stream_free_;
  std::multimap<int64_t, double> waits_; // work at the wait -> when the collective is done
};

} // namespace

StepTime predict_step_time(const RankReport& report, const TimeModelOptions& o) {
  DTENSOR_CHECK(o.achieved_tflops() > 0, "TimeModelOptions: achieved_tflops must be positive, got {}",
                o.achieved_tflops());
  StepTime t;
  for (const auto& p : report.phases) {
    PhaseTime pt;
    pt.name = p.name;
    // A report built without the work (by hand, or by a recorder that did not count it):
    // its FLOPs.
    const int64_t work = p.work_flops > 0 ? p.work_flops : p.flops;
    pt.compute_s = static_cast<double>(work) / (o.achieved_tflops() * 1e12);
    Timeline line(o);
    for (const auto& c : p.collectives) {
      line.issue(c, pt);
    }
    pt.total_s = line.finish(work);
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
