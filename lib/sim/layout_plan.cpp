// One layout's step in closed form: compute, each dimension's communication by NCCL's
// algorithms (dtensor/collective_cost.h), the pipeline's bubble by the schedule simulator, and
// memory by term ([Note: the planner's step] below; dtensor/layout_planner.h).
#include <dtensor/layout_planner.h>
#include <dtensor/pipeline_schedule.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

#include "internal/check.h"

namespace dtensor {

namespace {

// [Note: the planner's step] The busiest rank of a layout, per microbatch of T = microbatch x
// seq / cp tokens (tp splits heads, widths and, between blocks, the sequence):
// - compute: 2 FLOPs per active weight per token (an MoE block's chosen and shared experts),
//   attention's causal work (queries see (seq + 1) / 2 keys on average; a sliding-window
//   block the window), backward twice forward, full checkpointing one more forward of every
//   block, at `efficiency` x the cluster's peak (float8 products at twice the peak);
// - tp: sequence parallelism's two all-gathers and two reduce-scatters of [T, dim] a block each
//   way (and again in a recomputed forward), blocking compute, as dtensor issues them;
// - cp: allgather gathers K / V and reduce-scatters their gradients (blocking); ring passes
//   K / V chunks cp - 1 times (K / V and their gradients backward), each hidden under its
//   block of attention; ulysses exchanges q / k / v and the output all-to-all (blocking);
// - ep: the dispatch and combine all-to-alls of T / tp x top-k rows a MoE block each way
//   (tp_overlap / ep_overlap: hidden under the block's products / compute where they fit);
// - dp: fully_shard's bf16 all-gathers (forward and backward) and fp32 reduce-scatters per
//   microbatch (pp: once a step, parameters kept unsharded and gradients accumulated
//   unsharded between), HSDP's all-reduce of the shards, overlapped with the phase's compute
//   but the first all-gather and the last reduction;
// - pp: the busiest stage (ceil(layers / stages) blocks, and the output and the loss, which the
//   last rank runs once a microbatch, a 1 / v share on each of its v stages) costs every stage
//   its time, and the schedule simulator's makespan gives the step; each stage's output is
//   sent to the next.
// Groups are those of rank 0 on the mesh (pp, dp_replicate, dp_shard, cp, tp), tp innermost;
// ep takes the innermost ranks of dp_shard x cp (the experts then split over tp as well), or,
// when ep does not divide dp_shard x cp, tp's ranks and the innermost of dp_shard x cp
// (experts whole on a rank: torchtitan's etp 1).
constexpr double kBf16 = 2;
constexpr double kFp32 = 4;

std::vector<int> strided(int64_t size, int64_t stride) {
  std::vector<int> r;
  for (int64_t i = 0; i < size; ++i) {
    r.push_back(static_cast<int>(i * stride));
  }
  return r;
}

bool ep_spans_tp(const Layout& l) {
  return (l.dp_shard() * l.cp()) % l.ep() != 0;
}

// What the routed experts' weights are split over: ep, and tp unless ep took tp's ranks.
int64_t expert_split(const Layout& l) {
  return ep_spans_tp(l) ? l.ep() : l.ep() * l.tp();
}

// fully_shard's group for the experts: the rest of dp_shard x cp (x tp where ep spans it).
int64_t expert_fsdp(const Layout& l) {
  return l.dp_shard() * l.cp() * (ep_spans_tp(l) ? l.tp() : 1) / l.ep();
}

struct Groups {
  std::vector<int> tp, cp, fsdp, efsdp, ep, rep, pp;
};

Groups groups_of(const Layout& l) {
  const int64_t f = l.dp_shard() * l.cp();
  const bool spans = ep_spans_tp(l);
  return Groups{strided(l.tp(), 1),
                strided(l.cp(), l.tp()),
                strided(f, l.tp()),
                strided(expert_fsdp(l), spans ? l.ep() : l.tp() * l.ep()),
                strided(l.ep(), spans ? 1 : l.tp()),
                strided(l.dp_replicate(), l.tp() * f),
                strided(2, l.world() / l.pp())};
}

// A collective's seconds on the cluster, remembered: a search asks for the same few sizes and
// groups (ranks strided from 0) many times. The cluster is keyed by its row and links.
double cost(CollectiveKind kind, double bytes, const std::vector<int>& ranks,
            const ClusterSpec& c) {
  if (ranks.size() < 2 || bytes <= 0) {
    return 0;
  }
  using Key = std::tuple<int, int64_t, size_t, int, std::string, int64_t, double, double>;
  static std::mutex mutex;
  static std::map<Key, double> cache;
  const Key key{static_cast<int>(kind),
                static_cast<int64_t>(bytes),
                ranks.size(),
                ranks[1] - ranks[0],
                c.name(),
                c.gpus_per_node(),
                c.nvlink_gbps(),
                c.network_gbps()};
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) {
    return it->second;
  }
  const double s = collective_cost(kind, static_cast<int64_t>(bytes), ranks, c).seconds;
  cache.emplace(key, s);
  return s;
}

struct Dims {
  int64_t qk, v, kv_heads;
};

Dims dims_of(const TransformerShape& m) {
  if (m.kv_lora_rank() > 0) { // latent attention: full heads after the up-projection
    return {m.head_dim() + m.qk_rope_head_dim(), m.v_head_dim(), m.heads()};
  }
  return {m.head_dim(), m.head_dim(), m.kv_heads()};
}

int64_t active_ffn(const TransformerShape& m, bool moe) {
  return moe ? (m.experts_per_token() + m.shared_experts()) * m.expert_hidden() : m.ffn_hidden();
}

int64_t routed_expert_parameters(const TransformerShape& m) {
  return m.experts() * 3 * m.dim() * m.expert_hidden();
}

// One block, one microbatch, this rank: seconds by term and bytes saved for backward.
struct Block {
  double fwd = 0, bwd = 0;       // compute
  double tp_fwd = 0, tp_bwd = 0; // blocking collectives
  double cp_fwd = 0, cp_bwd = 0;
  double ep_fwd = 0, ep_bwd = 0;
  double saved = 0;      // bytes kept for backward under the policy
  double saved_none = 0; // ... with no checkpointing (a recomputed block's transient)
  double buffers = 0;    // exchange buffers alive at once
};

double attention_context(const TransformerShape& m, int64_t seq) {
  const double causal = (static_cast<double>(seq) + 1) / 2;
  if (m.sliding_window() == 0) {
    return causal;
  }
  return 0.5 * (causal + std::min<double>(static_cast<double>(m.sliding_window()), causal));
}

Block block_costs(const TransformerShape& m, const JobShape& job, const Layout& l,
                  const PlannerOptions& o, const Groups& g, bool moe) {
  const ClusterSpec& c = o.cluster();
  const double t = static_cast<double>(l.microbatch() * job.seq() / l.cp());
  const double tp = static_cast<double>(l.tp());
  const Dims d = dims_of(m);
  const double kv = static_cast<double>(d.kv_heads) / tp;
  const double heads = static_cast<double>(m.heads()) / tp;
  const double peak = o.efficiency() * c.bf16_tflops() * 1e12;
  Block b;
  const double active = static_cast<double>(block_parameters(m, moe)) -
                        (moe ? static_cast<double>(routed_expert_parameters(m)) : 0) +
                        (moe ? 3.0 * m.dim() * m.experts_per_token() * m.expert_hidden() : 0);
  const double products = 2 * t * active / tp / (job.float8() ? 2 * peak : peak);
  const double attention_rate =
      o.attention_efficiency() > 0 ? o.attention_efficiency() * c.bf16_tflops() * 1e12 : peak;
  const double attention = 2 * t * heads * static_cast<double>(d.qk + d.v) *
                           attention_context(m, job.seq()) / attention_rate;
  b.fwd = products + attention;
  b.bwd = 2 * b.fwd;
  const double act = t * m.dim() * kBf16;
  const double tp_pair = cost(CollectiveKind::AllGather, act, g.tp, c) +
                         cost(CollectiveKind::ReduceScatter, act, g.tp, c);
  b.tp_fwd = b.tp_bwd = 2 * tp_pair;
  const double kv_bytes = t * kv * static_cast<double>(d.qk + d.v) * kBf16;
  if (l.cp() > 1 && l.cp_method() == "allgather") {
    // Each beside the rank's own block ([Note: the all-gather beside the own block] in
    // lib/parallel/cp/methods.cpp).
    const double own = attention / static_cast<double>(l.cp());
    b.cp_fwd = std::max(0.0, cost(CollectiveKind::AllGather, kv_bytes * l.cp(), g.cp, c) - own);
    b.cp_bwd =
        std::max(0.0, cost(CollectiveKind::ReduceScatter, kv_bytes * l.cp(), g.cp, c) - 2 * own);
    b.buffers += kv_bytes * l.cp();
  } else if (l.cp() > 1 && l.cp_method() == "ring") {
    const double steps = static_cast<double>(l.cp() - 1);
    // A ring step waits for its slowest transfer: the wrap-around pair, across nodes where the
    // group spans them.
    const std::vector<int> pair{g.cp.front(), g.cp.back()};
    const double block = attention / static_cast<double>(l.cp());
    b.cp_fwd = steps * std::max(0.0, cost(CollectiveKind::Send, kv_bytes, pair, c) - block);
    b.cp_bwd = steps * std::max(0.0, cost(CollectiveKind::Send, 2 * kv_bytes, pair, c) - 2 * block);
    b.buffers += 4 * kv_bytes;
  } else if (l.cp() > 1) { // ulysses
    const double qkv = t * (heads * d.qk + kv * (d.qk + d.v)) * kBf16;
    const double out = t * heads * d.v * kBf16;
    b.cp_fwd = b.cp_bwd =
        cost(CollectiveKind::AllToAll, qkv, g.cp, c) + cost(CollectiveKind::AllToAll, out, g.cp, c);
    b.buffers += 2 * qkv;
  }
  const double rows = moe ? t / tp * static_cast<double>(m.experts_per_token()) : 0;
  if (moe && l.ep() > 1) {
    b.ep_fwd = b.ep_bwd = 2 * cost(CollectiveKind::AllToAll, rows * m.dim() * kBf16, g.ep, c);
    b.buffers += 2 * rows * m.dim() * kBf16;
  }
  // Saved for backward, in elements per token (docs/simulation.md, "Choosing the layout").
  const double qkv_el = heads * d.qk + kv * (d.qk + d.v);
  const double out_el = heads * d.v;
  const double ffn_el = static_cast<double>(active_ffn(m, moe)) / tp;
  const double dim = static_cast<double>(m.dim());
  const double dispatch_el = moe ? 2 * rows / t * dim : 0;
  const double none = 2 * dim / tp + 2 * dim + qkv_el + out_el + 4 * ffn_el + dispatch_el;
  const double selective = dim / tp + qkv_el + out_el + 2 * dim + 2 * ffn_el + dispatch_el / 2;
  b.saved_none = none * t * kBf16;
  b.saved = (l.checkpoint() == CheckpointMode::None        ? none
             : l.checkpoint() == CheckpointMode::Selective ? selective
                                                           : dim / tp) *
            t * kBf16;
  if (o.tp_overlap()) { // hidden under the block's products, forward and backward
    b.tp_fwd = std::max(0.0, b.tp_fwd - products);
    b.tp_bwd = std::max(0.0, b.tp_bwd - 2 * products);
  }
  if (o.ep_overlap()) { // hidden under the block's compute
    b.ep_fwd = std::max(0.0, b.ep_fwd - b.fwd);
    b.ep_bwd = std::max(0.0, b.ep_bwd - b.bwd);
  }
  if (l.checkpoint() == CheckpointMode::Full) { // the forward again, its collectives too
    b.bwd += b.fwd;
    b.tp_bwd += b.tp_fwd;
    b.cp_bwd += b.cp_fwd;
    b.ep_bwd += b.ep_fwd;
  }
  return b;
}

void check_layout(const TransformerShape& m, const JobShape& job, const Layout& l) {
  const std::string what = to_string(l);
  DTENSOR_CHECK(l.dp_replicate() >= 1 && l.dp_shard() >= 1 && l.tp() >= 1 && l.pp() >= 1 &&
                    l.cp() >= 1 && l.ep() >= 1 && l.microbatch() >= 1 && l.virtual_stages() >= 1,
                "layout {}: every degree must be at least 1", what);
  DTENSOR_CHECK(m.heads() % l.tp() == 0, "layout {}: {} heads do not split over tp {}", what,
                m.heads(), l.tp());
  const int64_t kv = dims_of(m).kv_heads;
  DTENSOR_CHECK(kv % l.tp() == 0,
                "layout {}: {} K/V heads do not split over tp {} (dtensor's tensor parallelism "
                "shards K / V by head)",
                what, kv, l.tp());
  DTENSOR_CHECK(l.ep() == 1 || m.experts() > 0, "layout {}: ep {} on a dense model", what, l.ep());
  const int64_t f = l.dp_shard() * l.cp();
  DTENSOR_CHECK(l.ep() == 1 ||
                    (m.experts() % l.ep() == 0 &&
                     (f % l.ep() == 0 || (l.ep() % l.tp() == 0 && f % (l.ep() / l.tp()) == 0))),
                "layout {}: ep {} must divide the {} experts, and dp_shard x cp ({}) or "
                "dp_shard x cp x tp as a multiple of tp {}",
                what, l.ep(), m.experts(), f, l.tp());
  const int64_t dp = l.dp_replicate() * l.dp_shard();
  DTENSOR_CHECK(job.global_batch() % (dp * l.microbatch()) == 0,
                "layout {}: the global batch {} does not split into microbatches of {} over {} "
                "data-parallel ranks",
                what, job.global_batch(), l.microbatch(), dp);
  DTENSOR_CHECK(l.cp() == 1 || job.seq() % (2 * l.cp()) == 0,
                "layout {}: sequence {} does not split into 2 x cp {} chunks", what, job.seq(),
                l.cp());
  DTENSOR_CHECK(l.cp() == 1 || l.cp_method() == "allgather" || l.cp_method() == "ring" ||
                    l.cp_method() == "ulysses",
                "layout {}: cp method \"{}\" is not allgather, ring or ulysses", what,
                l.cp_method());
  DTENSOR_CHECK(l.cp_method() != "ulysses" || (m.heads() / l.tp()) % l.cp() == 0,
                "layout {}: ulysses needs the {} heads per tp rank to split over cp {}", what,
                m.heads() / l.tp(), l.cp());
  DTENSOR_CHECK(l.pp() * l.virtual_stages() <= m.layers(), "layout {}: {} stages for {} layers",
                what, l.pp() * l.virtual_stages(), m.layers());
}

// The makespan of a schedule in units of one stage's forward (each full backward `ratio`
// units, to 0.05, the makespan then scaled by (1 + ratio) over (1 + the rounded ratio)), and the
// most (stage, microbatch) activations rank 0 and the last rank hold. Past the warm-up every
// further round of pp microbatches adds the same time (the steady state), so a schedule of many
// microbatches is timed at two small counts and extended along that line, which the simulator gives
// exactly for 1F1B and Interleaved1F1B. Cached: the search meets each shape many times.
struct ScheduleShape {
  double makespan = 0;
  int peak_first = 1, peak_last = 1;
  double ratio = 2; // the rounded ratio it was timed at
};

ScheduleShape simulate_shape(ScheduleKind kind, int64_t pp, int64_t microbatches,
                             int64_t virtual_stages, double ratio) {
  const PipelineOrder order = generate_schedule(
      kind, static_cast<int>(pp), static_cast<int>(microbatches), static_cast<int>(virtual_stages));
  const ScheduleTimeline t = simulate_schedule(order, static_cast<int>(pp * virtual_stages),
                                               ScheduleCosts().forward(1.0).full_backward(ratio));
  return {t.makespan, t.peak_activations.front(), t.peak_activations.back(), ratio};
}

ScheduleShape schedule_shape(const std::string& schedule, int64_t pp, int64_t microbatches,
                             int64_t virtual_stages, double ratio) {
  using Key = std::tuple<std::string, int64_t, int64_t, int64_t, int64_t>;
  static std::mutex mutex;
  static std::map<Key, ScheduleShape> cache;
  const double rounded = static_cast<double>(std::llround(ratio * 20)) / 20.0;
  const Key key{schedule, pp, microbatches, virtual_stages, std::llround(ratio * 20)};
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache.find(key);
    if (it != cache.end()) {
      return it->second;
    }
  }
  const ScheduleKind kind = schedule_kind(schedule);
  const int64_t base = 4 * pp; // a multiple of pp past the warm-up
  ScheduleShape s;
  if (microbatches <= base + pp || microbatches % pp != 0) {
    s = simulate_shape(kind, pp, microbatches, virtual_stages, rounded);
  } else {
    s = simulate_shape(kind, pp, base + pp, virtual_stages, rounded);
    const ScheduleShape low = simulate_shape(kind, pp, base, virtual_stages, rounded);
    const double per_round = s.makespan - low.makespan;
    s.makespan +=
        per_round * static_cast<double>(microbatches - base - pp) / static_cast<double>(pp);
  }
  std::lock_guard<std::mutex> lock(mutex);
  cache[key] = s;
  return s;
}

} // namespace

namespace {

// What one rank of the busiest stage holds and runs: blocks per stage, and per microbatch
// the forward and backward of the rank's stage (output layer and loss included).
struct Stage {
  int64_t dense = 0, moe = 0; // blocks of one stage
  double f_compute = 0, b_compute = 0, f = 0, b = 0;
  double tp = 0, cp = 0, ep = 0; // both directions
  double saved = 0;              // activation bytes of one microbatch through the stage
  double transient = 0;          // a recomputed block's activations (full checkpointing)
  double buffers = 0;            // exchange buffers and the gathered activation (tp)
};

Stage stage_costs(const TransformerShape& m, const JobShape& job, const Layout& l,
                  const PlannerOptions& o, const Groups& g) {
  const ClusterSpec& c = o.cluster();
  const bool is_moe = m.experts() > 0;
  const int64_t stages = l.pp() * l.virtual_stages();
  Stage s;
  if (l.pp() == 1) {
    s.moe = is_moe ? m.layers() - m.dense_layers() : 0;
    s.dense = m.layers() - s.moe;
  } else { // the busiest stage: ceil(layers / stages) blocks, MoE ones where the model has them
    const int64_t per_stage = (m.layers() + stages - 1) / stages;
    (is_moe ? s.moe : s.dense) = per_stage;
  }
  const Block dense = block_costs(m, job, l, o, g, false);
  const Block moe = is_moe ? block_costs(m, job, l, o, g, true) : dense;
  const auto sum = [&](double Block::*field) {
    return static_cast<double>(s.dense) * (dense.*field) +
           static_cast<double>(s.moe) * (moe.*field);
  };
  const double t = static_cast<double>(l.microbatch() * job.seq() / l.cp());
  const double peak = o.efficiency() * c.bf16_tflops() * 1e12;
  // The output and the loss run on the last rank once a microbatch: over its stages, 1 / v a
  // stage (every rank then costs what the last one does).
  const double share = 1.0 / static_cast<double>(l.pp() == 1 ? 1 : l.virtual_stages());
  const double out = share * 2 * t * m.dim() * static_cast<double>(m.vocab()) / l.tp() / peak;
  const double act = t * m.dim() * kBf16;
  const double out_tp = share * cost(CollectiveKind::AllGather, act, g.tp, c);
  const double send = l.pp() > 1 ? cost(CollectiveKind::Send, act / l.tp(), g.pp, c) : 0;
  s.f_compute = sum(&Block::fwd) + out;
  s.b_compute = sum(&Block::bwd) + 2 * out;
  s.tp = sum(&Block::tp_fwd) + sum(&Block::tp_bwd) + 2 * out_tp;
  s.cp = sum(&Block::cp_fwd) + sum(&Block::cp_bwd);
  s.ep = sum(&Block::ep_fwd) + sum(&Block::ep_bwd);
  s.f =
      s.f_compute + sum(&Block::tp_fwd) + out_tp + sum(&Block::cp_fwd) + sum(&Block::ep_fwd) + send;
  s.b =
      s.b_compute + sum(&Block::tp_bwd) + out_tp + sum(&Block::cp_bwd) + sum(&Block::ep_bwd) + send;
  s.saved = sum(&Block::saved);
  s.transient =
      l.checkpoint() == CheckpointMode::Full ? std::max(dense.saved_none, moe.saved_none) : 0;
  s.buffers = std::max(dense.buffers, moe.buffers) + (l.tp() > 1 ? act : 0);
  return s;
}

// fully_shard's parameters on a rank: unsharded over tp (experts over expert_split), in
// elements.
struct Sharded {
  double dense = 0, experts = 0; // unsharded sizes on this rank
  int64_t units = 0, moe_units = 0;
};

Sharded rank_parameters(const TransformerShape& m, const Layout& l, const Stage& s) {
  const int64_t v = l.pp() == 1 ? 1 : l.virtual_stages();
  const double routed = static_cast<double>(routed_expert_parameters(m));
  const double embeddings = // and the final norm
      (l.pp() == 1 ? 2.0 : 1.0) * static_cast<double>(m.vocab() * m.dim()) +
      static_cast<double>(m.dim());
  Sharded p;
  p.units = v * (s.dense + s.moe) + (l.pp() == 1 ? 2 : 1);
  p.moe_units = v * s.moe;
  p.dense =
      (static_cast<double>(v * s.dense * block_parameters(m, false)) +
       static_cast<double>(v * s.moe) * (static_cast<double>(block_parameters(m, true)) - routed) +
       embeddings) /
      static_cast<double>(l.tp());
  p.experts = static_cast<double>(v * s.moe) * routed / static_cast<double>(expert_split(l));
  return p;
}

struct DataParallel {
  double first_gather = 0, gathers = 0, last_reduce = 0, reduces = 0;
};

DataParallel data_parallel(const Sharded& p, const Layout& l, const Groups& g,
                           const ClusterSpec& c) {
  DataParallel d;
  const double units = static_cast<double>(p.units);
  const double moe = static_cast<double>(p.moe_units);
  const double f = static_cast<double>(l.dp_shard() * l.cp());
  const auto each = [&](CollectiveKind kind, double bytes_dense, double bytes_experts,
                        const std::vector<int>& dense_group, const std::vector<int>& expert_group) {
    double total = units * cost(kind, bytes_dense / units, dense_group, c);
    if (moe > 0) {
      total += moe * cost(kind, bytes_experts / moe, expert_group, c);
    }
    return total;
  };
  d.gathers = each(CollectiveKind::AllGather, p.dense * kBf16, p.experts * kBf16, g.fsdp, g.efsdp);
  d.reduces =
      each(CollectiveKind::ReduceScatter, p.dense * kFp32, p.experts * kFp32, g.fsdp, g.efsdp) +
      each(CollectiveKind::AllReduce, p.dense * kFp32 / f,
           p.experts * kFp32 / static_cast<double>(expert_fsdp(l)), g.rep, g.rep);
  d.first_gather = d.gathers / (units + moe);
  d.last_reduce = d.reduces / (units + moe);
  return d;
}

} // namespace

namespace {

// Model FLOPs per token: three times the forward's (causal attention's work), as MFU counts.
double model_flops_per_token(const TransformerShape& m, int64_t seq) {
  const Dims d = dims_of(m);
  const int64_t moe_layers = m.experts() > 0 ? m.layers() - m.dense_layers() : 0;
  const auto active = [&](bool moe) {
    return static_cast<double>(block_parameters(m, moe)) -
           (moe ? static_cast<double>(routed_expert_parameters(m)) -
                      3.0 * m.dim() * m.experts_per_token() * m.expert_hidden()
                : 0);
  };
  return 6 * (static_cast<double>(m.layers() - moe_layers) * active(false) +
              static_cast<double>(moe_layers) * active(true) +
              static_cast<double>(m.dim() * m.vocab())) +
         6 * static_cast<double>(m.layers() * m.heads() * (d.qk + d.v)) * attention_context(m, seq);
}

// The step: the schedule's makespan (pp) or the microbatches one after another, and
// fully_shard's traffic beyond what compute hides. `shape` receives the schedule's shape.
TimeTerms time_terms(const JobShape& job, const Layout& l, const Stage& s, const DataParallel& d,
                     ScheduleShape& shape) {
  const int64_t microbatches =
      job.global_batch() / (l.dp_replicate() * l.dp_shard()) / l.microbatch();
  const double v = static_cast<double>(l.virtual_stages());
  const double mb = static_cast<double>(microbatches);
  TimeTerms t;
  double makespan = mb * (s.f + s.b);
  if (l.pp() > 1) {
    shape = schedule_shape(l.schedule(), l.pp(), microbatches, l.virtual_stages(), s.b / s.f);
    // Back from the rounded ratio: exact where the makespan is a multiple of f + b (1F1B).
    makespan = shape.makespan * s.f * (1 + s.b / s.f) / (1 + shape.ratio);
    t.dp = d.first_gather + std::max(0.0, d.gathers - d.first_gather - v * s.f_compute) +
           d.last_reduce + std::max(0.0, d.reduces - d.last_reduce - v * s.b_compute);
  } else {
    t.dp =
        mb * (d.first_gather + std::max(0.0, d.gathers - d.first_gather - s.f_compute) +
              d.last_reduce + std::max(0.0, d.gathers + d.reduces - d.last_reduce - s.b_compute));
  }
  t.compute = mb * v * (s.f_compute + s.b_compute);
  t.tp = mb * v * s.tp;
  t.cp = mb * v * s.cp;
  t.ep = mb * v * s.ep;
  t.pp = makespan - t.compute - t.tp - t.cp - t.ep;
  t.step = makespan + t.dp;
  const double tokens = static_cast<double>(job.global_batch() * job.seq());
  t.tokens_per_second_per_gpu = tokens / t.step / static_cast<double>(l.world());
  return t;
}

// The busiest rank's bytes by term: the first pipeline rank (the most microbatches in flight)
// or the last (the logits), whichever holds more.
MemoryTerms memory_terms(const TransformerShape& m, const JobShape& job, const Layout& l,
                         const Stage& s, const Sharded& p, const ScheduleShape& shape,
                         double fragmentation) {
  MemoryTerms mem;
  const double fsdp = static_cast<double>(l.dp_shard() * l.cp());
  const double shards = p.dense / fsdp + p.experts / static_cast<double>(expert_fsdp(l));
  mem.parameters = shards * kFp32;
  mem.gradients = shards * kFp32;
  mem.optimizer = 2 * shards * kFp32;
  const double largest_unit =
      std::max({p.dense / static_cast<double>(p.units),
                static_cast<double>(m.vocab() * m.dim()) / static_cast<double>(l.tp())}) +
      (p.moe_units > 0 ? p.experts / static_cast<double>(p.moe_units) : 0);
  mem.unsharded =
      l.pp() == 1 ? largest_unit * (2 * kBf16 + kFp32) : (p.dense + p.experts) * (kBf16 + kFp32);
  const double logits = static_cast<double>(l.microbatch() * job.seq() / l.cp()) *
                        static_cast<double>(m.vocab()) / static_cast<double>(l.tp()) *
                        (kBf16 + 2 * kFp32);
  const double first = static_cast<double>(shape.peak_first) * s.saved;
  const double last = static_cast<double>(shape.peak_last) * s.saved;
  const bool last_heavier = l.pp() == 1 || last + logits > first;
  mem.activations = (last_heavier ? last : first) + s.transient;
  mem.logits = last_heavier ? logits : 0;
  mem.buffers = s.buffers;
  mem.total = (mem.parameters + mem.gradients + mem.optimizer + mem.unsharded + mem.activations +
               mem.logits + mem.buffers) *
              fragmentation;
  return mem;
}

} // namespace

LayoutPlan plan_layout(const TransformerShape& m, const JobShape& job, const Layout& layout,
                       const PlannerOptions& o) {
  check_layout(m, job, layout);
  Layout l = layout;
  if (l.pp() == 1) {
    l.virtual_stages(1).schedule("");
  }
  DTENSOR_CHECK(l.pp() == 1 || l.virtual_stages() == 1 ||
                    !is_single_stage(schedule_kind(l.schedule())),
                "layout {}: {} runs one stage per rank", to_string(l), l.schedule());
  const ClusterSpec& c = o.cluster();
  const Groups g = groups_of(l);
  const Stage s = stage_costs(m, job, l, o, g);
  const Sharded p = rank_parameters(m, l, s);
  LayoutPlan plan;
  plan.layout = l;
  ScheduleShape shape;
  plan.time = time_terms(job, l, s, data_parallel(p, l, g, c), shape);
  plan.time.mfu = plan.time.tokens_per_second_per_gpu * model_flops_per_token(m, job.seq()) /
                  (c.bf16_tflops() * 1e12);
  plan.memory = memory_terms(m, job, l, s, p, shape, o.fragmentation());
  const double gib = 1024.0 * 1024 * 1024;
  const double limit = (o.memory_gib() > 0 ? o.memory_gib() : c.memory_gib()) * gib;
  plan.fits = plan.memory.total <= limit;
  if (!plan.fits) {
    plan.why = fmt::format("needs {:.1f} GiB of {:.1f}", plan.memory.total / gib, limit / gib);
  }
  return plan;
}

} // namespace dtensor
