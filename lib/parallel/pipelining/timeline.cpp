// The timed simulation of a compute schedule (simulate_schedule,
// include/dtensor/pipeline_schedule.h). [Note: timing a pipeline schedule]
//
// [Note: timing a pipeline schedule]
// PyTorch's dry run (_simulate_comms_compute) replays a schedule in untimed lock steps; this
// one gives each action a duration and starts it at the later of (its rank is free) and (its
// input exists): the previous stage's forward of the microbatch for a forward, the next
// stage's backward (B or I) for a backward, its own I for a W, each plus p2p_latency when the
// producer is on another rank. Ranks run their actions in order, so a list schedule over the
// ranks, each placing its next action once the producer's end is known, gives every start
// time; a pass that places nothing means the schedule cannot complete. With unit costs
// (F = I = W = 1, B = 2) the bubble equals the closed forms (p-1)/(m+p-1) for GPipe and 1F1B
// and (p-1)/(v m+p-1) for Interleaved 1F1B (docs/pipeline.md, test/pipelining/).
// Peak activations follow PyTorch's analyze_pipeline_activation_liveness: a (stage,
// microbatch) is held from its forward through its B or W, both ends inclusive, counted over
// the rank's order.
#include <dtensor/pipeline_schedule.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "internal/check.h"
#include "parallel/pipelining/schedule_parts.h"

namespace dtensor {

namespace {

using AT = ActionType;
using Key = std::tuple<int, AT, int>;

double cost_of(const PipelineAction& a, const ScheduleCosts& c) {
  if (c.action_cost()) {
    const double own = c.action_cost()(a);
    if (own >= 0) {
      return own;
    }
  }
  switch (a.type) {
  case AT::Forward:
    return c.forward();
  case AT::BackwardInput:
    return c.backward_input();
  case AT::BackwardWeight:
    return c.backward_weight();
  case AT::FullBackward:
    return c.full_backward();
  case AT::OverlapFB: {
    if (c.overlapped_f_b() > 0) {
      return c.overlapped_f_b();
    }
    double sum = 0;
    for (const auto& s : a.sub_actions) {
      sum += cost_of(s, c);
    }
    return sum;
  }
  default:
    return 0.0;
  }
}

using detail::parts_of;

class Timer {
 public:
  Timer(const PipelineOrder& order, int num_stages, const ScheduleCosts& costs)
      : costs_(costs), num_stages_(num_stages),
        placement_(validate_schedule(order, num_stages, microbatches(order))) {
    for (const auto& rank : order) {
      std::vector<PipelineAction> actions;
      for (const auto& a : rank) {
        if (a) {
          actions.push_back(*a);
        }
      }
      ranks_.push_back(std::move(actions));
    }
  }

  ScheduleTimeline run() {
    size_t p = ranks_.size();
    std::vector<size_t> next(p, 0);
    std::vector<double> free(p, 0.0);
    ScheduleTimeline t;
    t.busy.assign(p, 0.0);
    size_t left = 0;
    for (const auto& r : ranks_) {
      left += r.size();
    }
    while (left > 0) {
      bool placed = false;
      for (size_t r = 0; r < p; ++r) {
        while (next[r] < ranks_[r].size()) {
          const PipelineAction& a = ranks_[r][next[r]];
          std::optional<double> ready = inputs_ready(a, static_cast<int>(r));
          if (!ready) {
            break;
          }
          double start = std::max(free[r], *ready);
          double end = start + cost_of(a, costs_);
          for (const auto& part : parts_of(a)) {
            end_[{part.stage, part.type, *part.microbatch}] = end;
          }
          t.actions.push_back({static_cast<int>(r), a, start, end});
          t.busy[r] += end - start;
          free[r] = end;
          t.makespan = std::max(t.makespan, end);
          ++next[r];
          --left;
          placed = true;
        }
      }
      if (!placed) {
        stuck(next);
      }
    }
    double busy = 0;
    for (double b : t.busy) {
      busy += b;
    }
    t.bubble_fraction = t.makespan > 0 ? 1.0 - busy / (static_cast<double>(p) * t.makespan) : 0.0;
    for (const auto& r : ranks_) {
      t.peak_activations.push_back(peak_activations(r));
    }
    return t;
  }

 private:
  static int microbatches(const PipelineOrder& order) {
    int m = 0;
    for (const auto& rank : order) {
      for (const auto& a : rank) {
        if (a) {
          for (const auto& part : parts_of(*a)) {
            m = std::max(m, part.microbatch.value_or(-1) + 1);
          }
        }
      }
    }
    return m;
  }

  // The producer an action waits for, if any.
  std::optional<Key> producer(const PipelineAction& a) const {
    int mb = *a.microbatch;
    if (a.type == AT::Forward && a.stage > 0) {
      return Key{a.stage - 1, AT::Forward, mb};
    }
    if ((a.type == AT::FullBackward || a.type == AT::BackwardInput) && a.stage < num_stages_ - 1) {
      bool split = end_.count({a.stage + 1, AT::BackwardInput, mb}) > 0;
      return Key{a.stage + 1, split ? AT::BackwardInput : AT::FullBackward, mb};
    }
    if (a.type == AT::BackwardWeight) {
      return Key{a.stage, AT::BackwardInput, mb};
    }
    return std::nullopt;
  }

  std::optional<double> inputs_ready(const PipelineAction& a, int rank) const {
    double ready = 0.0;
    for (const auto& part : parts_of(a)) {
      auto from = producer(part);
      if (!from) {
        continue;
      }
      auto it = end_.find(*from);
      if (it == end_.end()) {
        return std::nullopt;
      }
      bool remote = placement_[std::get<0>(*from)] != rank;
      ready = std::max(ready, it->second + (remote ? costs_.p2p_latency() : 0.0));
    }
    return ready;
  }

  [[noreturn]] void stuck(const std::vector<size_t>& next) const {
    std::vector<std::string> waiting;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      if (next[r] < ranks_[r].size()) {
        const auto& a = ranks_[r][next[r]];
        std::string on;
        for (const auto& part : parts_of(a)) {
          auto from = producer(part);
          if (from && !end_.count(*from)) {
            auto [s, type, mb] = *from;
            on = fmt::format("{}{}{} on rank {}", s, action_type_name(type), mb, placement_[s]);
          }
        }
        waiting.push_back(fmt::format("rank {} at {} waits for {}", r, a.str(), on));
      }
    }
    DTENSOR_FAIL("pipeline schedule cannot complete: {}", fmt::join(waiting, "; "));
  }

  static int peak_activations(const std::vector<PipelineAction>& actions) {
    std::map<std::pair<int, int>, std::pair<size_t, size_t>>
        life; // (stage, mb) -> [forward, release]
    for (size_t i = 0; i < actions.size(); ++i) {
      for (const auto& part : parts_of(actions[i])) {
        std::pair<int, int> k{part.stage, *part.microbatch};
        if (part.type == AT::Forward) {
          life[k].first = i;
        } else if (part.type == AT::FullBackward || part.type == AT::BackwardWeight) {
          life[k].second = i;
        }
      }
    }
    int peak = 0;
    for (size_t i = 0; i < actions.size(); ++i) {
      int live = 0;
      for (const auto& [k, span] : life) {
        live += span.first <= i && i <= span.second ? 1 : 0;
      }
      peak = std::max(peak, live);
    }
    return peak;
  }

  const ScheduleCosts& costs_;
  int num_stages_;
  std::vector<int> placement_;
  std::vector<std::vector<PipelineAction>> ranks_;
  std::map<Key, double> end_;
};

} // namespace

ScheduleTimeline simulate_schedule(const PipelineOrder& compute, int num_stages,
                                   const ScheduleCosts& costs) {
  detail::check_compute_only(compute, "simulate_schedule");
  return Timer(compute, num_stages, costs).run();
}

} // namespace dtensor
