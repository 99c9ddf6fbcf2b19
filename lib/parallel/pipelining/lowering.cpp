// Checking and lowering a compute schedule (validate_schedule, lower_schedule in
// include/dtensor/pipeline_schedule.h): the passes of PyTorch 2.15's pipelining runtime, in
// its order, so that the lowered programs compare equal action for action.
// [Note: lowering a pipeline schedule]
//
// [Note: lowering a pipeline schedule]
// Per rank: (1) UNSHARD a stage before its compute when it is among the next
// `unshard_lookahead` distinct stages and RESHARD stages that fall out of the next
// `max_active_stages`; (2) REDUCE_GRAD + WAIT_REDUCE_GRAD right after the action that
// completes a stage's m-th backward (B or W). Over all ranks: (3) a round-robin replay that
// emits each rank's next compute action once its input is there (a RECV of it, or the
// producing action of the same rank at a V's turn), appends the SEND after it and the
// matching RECV at once to the peer's program, so receives are posted as early as possible
// and every send meets its receive in the same order on both sides; a round without
// progress is a schedule that would deadlock. (4) WAIT_SEND_F after the local backward that
// proves the activation was received; every other send's wait at the end.
#include <dtensor/pipeline_schedule.h>

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <tuple>

#include "internal/check.h"
#include "parallel/pipelining/schedule_parts.h"

namespace dtensor {

namespace {

using AT = ActionType;
using Key = std::tuple<int, AT, int>; // stage, type, microbatch (-1: none)

PipelineAction make(int stage, AT type, std::optional<int> mb = std::nullopt) {
  PipelineAction a;
  a.stage = stage;
  a.type = type;
  a.microbatch = mb;
  return a;
}

Key key_of(const PipelineAction& a) {
  return {a.stage, a.type, a.microbatch.value_or(-1)};
}

using detail::parts_of;

// The first `count` distinct stages computed from position i on (a compound action's
// stages all count, so the result may exceed count).
std::vector<int> next_stages(const RankActions& actions, size_t i, int count) {
  std::vector<int> out;
  for (; i < actions.size(); ++i) {
    if (!actions[i]) {
      continue;
    }
    for (const auto& part : parts_of(*actions[i])) {
      if (std::find(out.begin(), out.end(), part.stage) == out.end()) {
        out.push_back(part.stage);
      }
    }
    if (static_cast<int>(out.size()) >= count) {
      break;
    }
  }
  return out;
}

std::vector<PipelineAction> add_unshard_reshard(const RankActions& actions, int max_active,
                                                int lookahead) {
  std::vector<int> active; // in the order they were unsharded
  std::vector<PipelineAction> out;
  auto contains = [](const std::vector<int>& v, int s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  for (size_t i = 0; i < actions.size(); ++i) {
    if (!actions[i]) {
      continue;
    }
    std::set<int> stages;
    for (const auto& part : parts_of(*actions[i])) {
      stages.insert(part.stage);
    }
    DTENSOR_CHECK(static_cast<int>(stages.size()) <= max_active,
                  "pipeline action {} computes {} stages at once, more than max_active_stages={}",
                  actions[i]->str(), stages.size(), max_active);
    std::vector<int> resident = next_stages(actions, i, max_active);
    std::vector<int> prefetch = next_stages(actions, i, lookahead);
    std::vector<int> evict;
    for (int s : active) {
      if (!contains(resident, s)) {
        evict.push_back(s);
      }
    }
    for (int s : evict) {
      active.erase(std::find(active.begin(), active.end(), s));
      out.push_back(make(s, AT::Reshard));
    }
    for (int s : prefetch) {
      if (!contains(active, s)) {
        active.push_back(s);
        out.push_back(make(s, AT::Unshard));
      }
    }
    out.push_back(*actions[i]);
  }
  for (int s : active) {
    out.push_back(make(s, AT::Reshard));
  }
  return out;
}

std::vector<PipelineAction> add_reduce_grad(const std::vector<PipelineAction>& actions,
                                            int microbatches) {
  std::map<int, int> backwards;
  std::vector<PipelineAction> out;
  for (const auto& a : actions) {
    out.push_back(a);
    for (const auto& part : parts_of(a)) {
      bool counts = part.type == AT::FullBackward || part.type == AT::BackwardWeight;
      if (counts && ++backwards[part.stage] == microbatches) {
        out.push_back(make(part.stage, AT::ReduceGrad));
        out.push_back(make(part.stage, AT::WaitReduceGrad));
      }
    }
  }
  return out;
}

class SendRecv {
 public:
  SendRecv(const std::vector<int>& placement)
      : placement_(placement), num_stages_(placement.size()) {}

  PipelineOrder run(std::vector<std::deque<PipelineAction>> todo) {
    size_t ranks = todo.size();
    PipelineOrder out(ranks);
    std::vector<std::set<Key>> done(ranks);
    while (std::any_of(todo.begin(), todo.end(), [](const auto& q) { return !q.empty(); })) {
      bool progress = false;
      for (size_t r = 0; r < ranks; ++r) {
        if (todo[r].empty()) {
          continue;
        }
        const PipelineAction a = todo[r].front();
        auto parts = parts_of(a);
        if (!std::all_of(parts.begin(), parts.end(),
                         [&](const auto& p) { return ready(p, done[r]); })) {
          continue;
        }
        out[r].emplace_back(a);
        for (const auto& p : parts) {
          done[r].insert(key_of(p));
          if (has_comms(p)) {
            bool fwd = p.type == AT::Forward;
            PipelineAction send = make(p.stage, fwd ? AT::SendF : AT::SendB, p.microbatch);
            PipelineAction recv =
                make(p.stage + (fwd ? 1 : -1), fwd ? AT::RecvF : AT::RecvB, p.microbatch);
            out[r].emplace_back(send);
            done[r].insert(key_of(send));
            size_t peer = placement_.at(recv.stage);
            out[peer].emplace_back(recv);
            done[peer].insert(key_of(recv));
          }
        }
        todo[r].pop_front();
        progress = true;
      }
      if (!progress) {
        stuck(todo);
      }
    }
    return out;
  }

 private:
  bool has_comms(const PipelineAction& a) const {
    if (a.type == AT::Forward) {
      return a.stage != num_stages_ - 1 && placement_[a.stage + 1] != placement_[a.stage];
    }
    if (a.type == AT::BackwardInput || a.type == AT::FullBackward) {
      return a.stage != 0 && placement_[a.stage - 1] != placement_[a.stage];
    }
    return false;
  }

  bool ready(const PipelineAction& a, const std::set<Key>& done) const {
    int mb = a.microbatch.value_or(-1);
    if (a.type == AT::Forward && a.stage != 0) {
      return done.count({a.stage, AT::RecvF, mb}) || done.count({a.stage - 1, AT::Forward, mb});
    }
    if ((a.type == AT::BackwardInput || a.type == AT::FullBackward) && a.stage != num_stages_ - 1) {
      return done.count({a.stage, AT::RecvB, mb}) ||
             done.count({a.stage + 1, AT::BackwardInput, mb}) ||
             done.count({a.stage + 1, AT::FullBackward, mb});
    }
    return true;
  }

  [[noreturn]] void stuck(const std::vector<std::deque<PipelineAction>>& todo) const {
    std::vector<std::string> waiting;
    for (size_t r = 0; r < todo.size(); ++r) {
      if (!todo[r].empty()) {
        waiting.push_back(fmt::format("rank {} at {}", r, todo[r].front().str()));
      }
    }
    DTENSOR_FAIL(
        "pipeline schedule deadlocks: no rank can run its next action, each waits for an input no "
        "other rank will send ({})",
        fmt::join(waiting, ", "));
  }

  const std::vector<int>& placement_;
  int num_stages_;
};

void add_wait_send(PipelineOrder& order) {
  for (auto& rank : order) {
    RankActions out;
    std::vector<Key> pending; // in the order sent
    for (auto& slot : rank) {
      const PipelineAction& a = *slot;
      out.push_back(a);
      if (a.type == AT::SendF || a.type == AT::SendB) {
        DTENSOR_CHECK(std::find(pending.begin(), pending.end(), key_of(a)) == pending.end(),
                      "pipeline schedule sends {} twice", a.str());
        pending.push_back(key_of(a));
      }
      for (const auto& part : parts_of(a)) {
        if (part.type != AT::FullBackward && part.type != AT::BackwardInput) {
          continue;
        }
        auto it =
            std::find(pending.begin(), pending.end(), Key{part.stage, AT::SendF, *part.microbatch});
        if (it != pending.end()) {
          out.push_back(make(part.stage, AT::WaitSendF, part.microbatch));
          pending.erase(it);
        }
      }
    }
    for (const auto& [stage, type, mb] : pending) {
      out.push_back(make(stage, type == AT::SendF ? AT::WaitSendF : AT::WaitSendB, mb));
    }
    rank = std::move(out);
  }
}

std::string where(size_t rank, size_t step, const PipelineAction& a) {
  return fmt::format("rank {}, step {} ({})", rank, step, a.str());
}

} // namespace

std::vector<int> validate_schedule(const PipelineOrder& order, int num_stages, int microbatches) {
  DTENSOR_CHECK(num_stages > 0 && microbatches > 0,
                "pipeline schedule: {} stages and {} microbatches", num_stages, microbatches);
  std::vector<int> placement(num_stages, -1);
  std::vector<std::map<AT, std::set<int>>> seen(num_stages);
  for (size_t r = 0; r < order.size(); ++r) {
    for (size_t step = 0; step < order[r].size(); ++step) {
      if (!order[r][step]) {
        continue;
      }
      for (const auto& a : parts_of(*order[r][step])) {
        std::string at = where(r, step, *order[r][step]);
        DTENSOR_CHECK(a.stage >= 0 && a.stage < num_stages,
                      "pipeline schedule, {}: stage {} is not one of the {} "
                      "stages",
                      at, a.stage, num_stages);
        if (a.is_compute()) {
          DTENSOR_CHECK(a.microbatch && *a.microbatch >= 0 && *a.microbatch < microbatches,
                        "pipeline schedule, {}: microbatch {} is not one of the {} microbatches",
                        at, a.microbatch ? std::to_string(*a.microbatch) : "(none)", microbatches);
          auto& s = seen[a.stage];
          int mb = *a.microbatch;
          DTENSOR_CHECK(
              a.type == AT::Forward || a.type == AT::BackwardWeight || s[AT::Forward].count(mb),
              "pipeline schedule, {}: backward of stage {}, microbatch {} before its forward", at,
              a.stage, mb);
          DTENSOR_CHECK(a.type != AT::BackwardWeight || s[AT::BackwardInput].count(mb),
                        "pipeline schedule, {}: weight gradient (W) of stage {}, microbatch {} "
                        "before its input "
                        "gradient (I)",
                        at, a.stage, mb);
          DTENSOR_CHECK(s[a.type].insert(mb).second,
                        "pipeline schedule, {}: stage {} runs {} of microbatch {} twice", at,
                        a.stage, action_type_name(a.type), mb);
        }
        DTENSOR_CHECK(placement[a.stage] < 0 || placement[a.stage] == static_cast<int>(r),
                      "pipeline schedule, {}: stage {} is on rank {} and rank {}", at, a.stage,
                      placement[a.stage], r);
        placement[a.stage] = static_cast<int>(r);
      }
    }
  }
  for (int s = 0; s < num_stages; ++s) {
    auto& c = seen[s];
    size_t f = c[AT::Forward].size(), b = c[AT::FullBackward].size();
    size_t i = c[AT::BackwardInput].size(), w = c[AT::BackwardWeight].size();
    DTENSOR_CHECK(f == static_cast<size_t>(microbatches),
                  "pipeline schedule: stage {} runs {} forwards, expected {}", s, f, microbatches);
    DTENSOR_CHECK(i == w && b + i == static_cast<size_t>(microbatches),
                  "pipeline schedule: stage {} runs B={} I={} W={} backwards, expected {} (B + I, "
                  "with I = W)",
                  s, b, i, w, microbatches);
  }
  return placement;
}

PipelineOrder lower_schedule(const PipelineOrder& compute, int num_stages, int microbatches,
                             const LoweringOptions& options) {
  detail::check_compute_only(compute, "lower_schedule");
  int max_active = options.max_active_stages();
  int lookahead = options.unshard_lookahead() == 0 ? max_active : options.unshard_lookahead();
  DTENSOR_CHECK(max_active >= 1 && lookahead >= 1 && lookahead <= max_active,
                "lower_schedule: unshard_lookahead {} must lie in [1, max_active_stages={}]",
                lookahead, max_active);
  std::vector<int> placement = validate_schedule(compute, num_stages, microbatches);
  std::vector<std::deque<PipelineAction>> per_rank;
  for (const auto& rank : compute) {
    auto actions = add_reduce_grad(add_unshard_reshard(rank, max_active, lookahead), microbatches);
    per_rank.emplace_back(actions.begin(), actions.end());
  }
  PipelineOrder order = SendRecv(placement).run(std::move(per_rank));
  add_wait_send(order);
  return order;
}

} // namespace dtensor
