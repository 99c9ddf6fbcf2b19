// The seven schedules' compute orders (generate_schedule, include/dtensor/pipeline_schedule.h),
// step for step as PyTorch 2.15's torch.distributed.pipelining generates them, so that their
// text and CSV compare equal (test/pipelining/). [Note: schedules as PyTorch orders them]
//
// [Note: schedules as PyTorch orders them]
// Each generator gives one rank's list; idle steps (std::nullopt) align the ranks in
// PyTorch's lock-step picture and are dropped by lowering. Where PyTorch's exported order is
// wrong we follow what its runtime runs instead: Schedule1F1B's exported order numbers the
// last rank's forwards 1..m (its runtime, and this order, 0..m-1). docs/pipeline.md
// describes each schedule, its bubble and its memory.
#include <dtensor/pipeline_schedule.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "internal/check.h"

namespace dtensor {

namespace {

using AT = ActionType;

PipelineAction act(int stage, AT type, int mb) {
  PipelineAction a;
  a.stage = stage;
  a.type = type;
  a.microbatch = mb;
  return a;
}

void idle(RankActions& out, int n) {
  for (int i = 0; i < n; ++i) {
    out.emplace_back(std::nullopt);
  }
}

RankActions gpipe(int p, int m, int r) {
  RankActions out;
  idle(out, r);
  for (int mb = 0; mb < m; ++mb) {
    out.emplace_back(act(r, AT::Forward, mb));
  }
  idle(out, 3 * (p - 1 - r));
  for (int mb = 0; mb < m; ++mb) {
    out.emplace_back(act(r, AT::FullBackward, mb));
  }
  return out;
}

RankActions one_f_one_b(int p, int m, int r) {
  RankActions out;
  idle(out, r);
  int fwd = 0;
  int bwd = 0;
  for (; fwd < p - 1 - r; ++fwd) {
    out.emplace_back(act(r, AT::Forward, fwd));
  }
  idle(out, 2 * (p - 1 - r));
  while (fwd < m) {
    out.emplace_back(act(r, AT::Forward, fwd++));
    out.emplace_back(act(r, AT::FullBackward, bwd++));
  }
  while (bwd < m) {
    out.emplace_back(std::nullopt);
    out.emplace_back(act(r, AT::FullBackward, bwd++));
  }
  return out;
}

RankActions looped_bfs(int p, int m, int v, int r) {
  RankActions out;
  idle(out, r);
  for (int k = 0; k < v; ++k) {
    for (int mb = 0; mb < m; ++mb) {
      out.emplace_back(act(r + k * p, AT::Forward, mb));
    }
  }
  idle(out, 2 * (p - 1 - r));
  for (int k = v - 1; k >= 0; --k) {
    for (int mb = m - 1; mb >= 0; --mb) {
      out.emplace_back(act(r + k * p, AT::FullBackward, mb));
    }
  }
  return out;
}

// Interleaved 1F1B and its zero-bubble variant: warm-up forwards, then one forward and one
// backward per step, then the remaining backwards; the zero-bubble variant splits each
// backward into I and a W that rank r delays by r steps.
RankActions interleaved(int p, int m, int v, int r, bool zero_bubble) {
  int rounds = std::max(1, m / p);
  int per_round = m / rounds;
  int warmup = std::min((v - 1) * per_round + (zero_bubble ? 1 : 2) * (p - 1 - r), m * v);
  int fwd_bwd = m * v - warmup;
  int total = warmup + fwd_bwd + warmup;
  int post_warmup = zero_bubble ? p - r - 1 : (v * p + 2 * (p - 1 - r)) - (warmup + r);
  auto fwd_stage = [&](int op) { return ((op / per_round) % v) * p + r; };
  auto bwd_stage = [&](int op) { return (v - 1 - ((op - warmup) / per_round) % v) * p + r; };
  AT backward = zero_bubble ? AT::BackwardInput : AT::FullBackward;

  std::map<int, int> fwd_mb, bwd_mb, weight_mb;
  std::vector<int> backward_ops;
  size_t weights = 0;
  RankActions out;
  idle(out, r);
  auto forward = [&](int op) {
    int s = fwd_stage(op);
    out.emplace_back(act(s, AT::Forward, fwd_mb[s]++));
  };
  auto backward_and_weight = [&](int op) {
    int s = bwd_stage(op);
    out.emplace_back(act(s, backward, bwd_mb[s]++));
    backward_ops.push_back(op);
    if (zero_bubble && op - warmup >= r) {
      int ws = bwd_stage(backward_ops[weights++]);
      out.emplace_back(act(ws, AT::BackwardWeight, weight_mb[ws]++));
    }
  };
  for (int op = 0; op < total; ++op) {
    if (op < warmup) {
      forward(op);
      if (op == warmup - 1) {
        idle(out, std::max(0, post_warmup));
      }
    } else if (op < warmup + fwd_bwd) {
      forward(op);
      backward_and_weight(op);
    } else {
      if (!zero_bubble) {
        out.emplace_back(std::nullopt);
      }
      backward_and_weight(op);
    }
  }
  while (zero_bubble && weights < backward_ops.size()) {
    int ws = bwd_stage(backward_ops[weights++]);
    out.emplace_back(act(ws, AT::BackwardWeight, weight_mb[ws]++));
  }
  return out;
}

// PyTorch's post-pass of the zero-bubble schedule: replays all ranks in lock step and waits
// (an idle step) where a forward's input from the previous stage has not been computed in
// an earlier step. Its backward test looks for B, which this schedule never emits.
PipelineOrder add_bubbles(const PipelineOrder& order, int num_stages) {
  using Key = std::tuple<int, AT, int>;
  std::set<Key> seen;
  auto need_bubble = [&](const PipelineAction& a) {
    int mb = a.microbatch.value_or(-1);
    if (a.type == AT::Forward) {
      return a.stage != 0 && !seen.count({a.stage - 1, AT::Forward, mb});
    }
    if (a.type == AT::FullBackward) {
      if (a.stage == num_stages - 1) {
        return !seen.count({a.stage, AT::Forward, mb});
      }
      return !seen.count({a.stage + 1, AT::FullBackward, mb});
    }
    return false;
  };
  PipelineOrder result(order.size());
  std::vector<size_t> next(order.size(), 0);
  while (true) {
    bool done = true;
    std::set<Key> step_seen;
    for (size_t r = 0; r < order.size(); ++r) {
      if (next[r] >= order[r].size()) {
        continue;
      }
      done = false;
      const auto& a = order[r][next[r]];
      if (!a) {
        ++next[r];
        result[r].emplace_back(std::nullopt);
      } else if (need_bubble(*a)) {
        result[r].emplace_back(std::nullopt);
      } else {
        result[r].push_back(a);
        if (a->microbatch) {
          step_seen.insert({a->stage, a->type, *a->microbatch});
        }
        ++next[r];
      }
    }
    seen.insert(step_seen.begin(), step_seen.end());
    if (done) {
      return result;
    }
  }
}

// ZB-V: rank r holds stages r and 2p-1-r; at least 2p-1 microbatches are generated and the
// ones past m become idle steps.
RankActions zbv(int p, int m, int r) {
  int n = std::max(2 * p - 1, m);
  int c0 = r;
  int c1 = 2 * p - 1 - r;
  int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  RankActions out;
  idle(out, r);
  auto emit = [&](int stage, AT type, int& counter) {
    out.emplace_back(act(stage, type, counter++));
  };
  for (int i = 0; i < 2 * (p - r) - 1; ++i) {
    emit(c0, AT::Forward, f0);
  }
  for (int i = 0; i < r; ++i) {
    emit(c1, AT::Forward, f1);
    emit(c0, AT::Forward, f0);
  }
  for (int i = 0; i < p - r; ++i) {
    emit(c1, AT::Forward, f1);
    out.emplace_back(act(c1, AT::BackwardInput, b1));
    emit(c1, AT::BackwardWeight, b1);
  }
  while (f1 < f0 || f0 < n) {
    if (f0 < n) {
      emit(c0, AT::Forward, f0);
    }
    out.emplace_back(act(c0, AT::BackwardInput, b0));
    emit(c0, AT::BackwardWeight, b0);
    emit(c1, AT::Forward, f1);
    out.emplace_back(act(c1, AT::BackwardInput, b1));
    emit(c1, AT::BackwardWeight, b1);
  }
  int w0 = b0, w1 = b1;
  for (int i = 0; i < r; ++i) {
    emit(c0, AT::BackwardInput, b0);
    emit(c1, AT::BackwardInput, b1);
  }
  for (int i = 0; i < p - r; ++i) {
    emit(c0, AT::BackwardInput, b0);
    emit(c0, AT::BackwardWeight, w0);
  }
  while (w1 < b1) {
    emit(c1, AT::BackwardWeight, w1);
  }
  while (w0 < b0) {
    emit(c0, AT::BackwardWeight, w0);
  }
  for (auto& a : out) {
    if (a && (!a->microbatch || *a->microbatch >= m)) {
      a.reset();
    }
  }
  return out;
}

// DualPipeV: the V of ZB-V, with the middle microbatches run as OVERLAP_F_B steps (a forward
// of one stage and a full backward of the other), and split backwards only at the ends.
class DualPipeV {
 public:
  DualPipeV(int p, int m, int r) : p_(p), m_(m), r_(r), s0_(r), s1_(2 * p - 1 - r) {}

  RankActions run() {
    for (int i = 0; i < 2 * (p_ - r_ - 1); ++i) {
      add(s0_, AT::Forward);
    }
    for (int i = 0; i < r_ + 1; ++i) {
      add(s0_, AT::Forward);
      add(s1_, AT::Forward);
    }
    for (int i = 0; i < p_ - r_ - 1; ++i) {
      add(s1_, AT::BackwardInput);
      add_weight();
      add(s1_, AT::Forward);
    }
    int main_steps = m_ - 2 * p_ + r_ + 1;
    for (int i = 0; i < main_steps; ++i) {
      if (i == 0 && r_ == p_ - 1) { // the last rank does not overlap its first pair
        add(s0_, AT::Forward);
        add(s1_, AT::FullBackward);
      } else {
        add_overlap(s0_, s1_);
      }
      add_overlap(s1_, s0_);
    }
    for (int i = 0; i < p_ - r_ - 1; ++i) {
      add(s1_, AT::FullBackward);
      add_overlap(s1_, s0_);
    }
    bool split = false;
    int half = r_ + 1;
    for (int i = 0; i < half; ++i) {
      split = split || (i == half / 2 && r_ % 2 == 1);
      add(s1_, split ? AT::BackwardInput : AT::FullBackward);
      split = split || (i == half / 2 && r_ % 2 == 0);
      add(s0_, split ? AT::BackwardInput : AT::FullBackward);
    }
    for (int i = 0; i < p_ - r_ - 1; ++i) {
      add_weight();
      add(s0_, split ? AT::BackwardInput : AT::FullBackward);
    }
    for (int i = 0; i < r_ + 1; ++i) {
      add_weight();
    }
    return std::move(out_);
  }

 private:
  // A full backward takes its microbatch from the I counter and advances I and W.
  void add(int stage, AT type) {
    AT key = type == AT::FullBackward ? AT::BackwardInput : type;
    int mb = counters_[{stage, key}];
    out_.emplace_back(act(stage, type, mb));
    if (type == AT::FullBackward) {
      ++counters_[{stage, AT::BackwardInput}];
      ++counters_[{stage, AT::BackwardWeight}];
      return;
    }
    if (type == AT::BackwardInput) {
      weights_.push_back({stage, mb});
    }
    counters_[{stage, key}] = mb + 1;
  }

  void add_weight() {
    if (weights_.empty()) {
      return;
    }
    auto [stage, mb] = weights_.front();
    weights_.erase(weights_.begin());
    out_.emplace_back(act(stage, AT::BackwardWeight, mb));
    ++counters_[{stage, AT::BackwardWeight}];
  }

  void add_overlap(int forward_stage, int backward_stage) {
    PipelineAction a;
    a.stage = -1;
    a.type = AT::OverlapFB;
    int f = counters_[{forward_stage, AT::Forward}]++;
    int b = counters_[{backward_stage, AT::BackwardInput}];
    a.sub_actions = {act(forward_stage, AT::Forward, f), act(backward_stage, AT::FullBackward, b)};
    out_.emplace_back(std::move(a));
    ++counters_[{backward_stage, AT::BackwardInput}];
    ++counters_[{backward_stage, AT::BackwardWeight}];
  }

  int p_, m_, r_, s0_, s1_;
  std::map<std::pair<int, AT>, int> counters_;
  std::vector<std::pair<int, int>> weights_;
  RankActions out_;
};

} // namespace

PipelineOrder generate_schedule(ScheduleKind kind, int pp, int microbatches, int stages_per_rank) {
  std::string_view name = schedule_name(kind);
  int p = pp, m = microbatches, v = stages_per_rank;
  DTENSOR_CHECK(
      p >= 1 && m >= 1 && v >= 1,
      "{}: pipeline ranks ({}), microbatches ({}) and stages per rank ({}) must be positive", name,
      p, m, v);
  if (is_single_stage(kind)) {
    DTENSOR_CHECK(v == 1, "{} runs one stage per rank, not {}", name, v);
  }
  if (kind == ScheduleKind::OneFOneB) {
    DTENSOR_CHECK(m >= p,
                  "1F1B: {} microbatches for {} stages; it needs at least one microbatch per stage",
                  m, p);
  }
  if (kind == ScheduleKind::Interleaved1F1B || kind == ScheduleKind::InterleavedZeroBubble) {
    int rounds = std::max(1, m / p);
    DTENSOR_CHECK(m % rounds == 0,
                  "{}: {} microbatches on {} pipeline ranks: the microbatches must be a multiple "
                  "of the {} rounds "
                  "(microbatches / ranks)",
                  name, m, p, rounds);
  }
  if (kind == ScheduleKind::ZBVZeroBubble || kind == ScheduleKind::DualPipeV) {
    DTENSOR_CHECK(v == 2, "{} needs exactly 2 stages per rank (a V), got {}", name, v);
  }
  if (kind == ScheduleKind::DualPipeV) {
    DTENSOR_CHECK(
        m >= 2 * p,
        "DualPipeV: {} microbatches for {} stages; it needs at least one microbatch per stage", m,
        2 * p);
  }
  PipelineOrder order;
  for (int r = 0; r < p; ++r) {
    switch (kind) {
    case ScheduleKind::GPipe:
      order.push_back(gpipe(p, m, r));
      break;
    case ScheduleKind::OneFOneB:
      order.push_back(one_f_one_b(p, m, r));
      break;
    case ScheduleKind::LoopedBFS:
      order.push_back(looped_bfs(p, m, v, r));
      break;
    case ScheduleKind::Interleaved1F1B:
      order.push_back(interleaved(p, m, v, r, false));
      break;
    case ScheduleKind::InterleavedZeroBubble:
      order.push_back(interleaved(p, m, v, r, true));
      break;
    case ScheduleKind::ZBVZeroBubble:
      order.push_back(zbv(p, m, r));
      break;
    case ScheduleKind::DualPipeV:
      order.push_back(DualPipeV(p, m, r).run());
      break;
    }
  }
  if (kind == ScheduleKind::InterleavedZeroBubble) {
    order = add_bubbles(order, p * v);
  }
  return order;
}

} // namespace dtensor
