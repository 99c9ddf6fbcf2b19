// Context parallelism's second generation (docs/context_parallel.md): every method (all-gather,
// ring, Ulysses's heads <-> sequence all-to-alls, hierarchical: Ulysses in groups, the ring
// across them) on 2, 4 and 8 ranks equals plain attention on the whole sequence with an
// explicit mask (outputs, log-sum-exp, dq / dk / dv; fp32, atol 2e-6, rtol 1e-5): every
// balancer and the documents-by-cost layout, causal or not, documents of any length (37, 1,
// 21, 5 as packed data has them; per batch row), grouped-query heads (exchanged unrepeated by
// the all-to-alls). Ulysses' all-to-alls and the hierarchical method's all-to-alls and ring
// exchanges counted with their exact bytes; head counts and group sizes that do not divide
// refused on every rank, naming them. The planner's view: each method's attention work (causal
// kernels' masked part skipped) is plain attention's over cp, the ring's transfers are stamped
// between its blocks, and the time model's timeline on hand-built phases.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <dtensor/context_parallel.h>

#include "support/cp_reference.h"
#include "support/prelude.h"

using dtensor::ContextParallelOptions;
using dtensor::CpBalance;
using dtensor::CpLayout;
using dtensor::CpMethod;
using namespace cp_test;

namespace {

constexpr int64_t kSeq = 64, kQHeads = 8;

struct Case {
  CpBalance balance;
  Docs docs;
};

// 64 rows split over up to 8 ranks: every balancer, documents a balancer can split and
// documents of any length, a different set per batch row.
std::vector<Case> cases(int64_t cp) {
  const int64_t c = 2 * cp;
  return {
      {CpBalance::None, {}},
      {CpBalance::HeadTail, {}},
      {CpBalance::PerDocument, {{c, kSeq - c}}},
      {CpBalance::HeadTail, {{37, 1, 21, 5}}},
      {CpBalance::None, {{3, 1, 60}, {32, 32}}},
      {CpBalance::Documents, {}},
      {CpBalance::Documents, {{37, 1, 21, 5}}},
      {CpBalance::Documents, {{3, 1, 60}, {32, 32}}},
  };
}

// One attention call's collectives on this rank's rows of `in`: counts and bytes by kind,
// forward, then backward.
struct CallComms {
  std::map<CollectiveKind, int64_t> fwd, bwd, fwd_bytes, bwd_bytes;
};

CallComms comms_of_call(const Inputs& in, const DeviceMesh& mesh, const CpLayout& layout,
                        const ContextParallelOptions& opts) {
  at::Tensor q = dtensor::cp_shard(in.q, 2, layout, mesh).requires_grad_();
  at::Tensor k = dtensor::cp_shard(in.k, 2, layout, mesh).requires_grad_();
  at::Tensor v = dtensor::cp_shard(in.v, 2, layout, mesh).requires_grad_();
  CallComms c;
  const auto bytes = [](const CommDebugMode& mode) {
    std::map<CollectiveKind, int64_t> out;
    for (const auto& [kind, n] : mode.comm_counts()) {
      out[kind] = mode.bytes_in(kind);
    }
    return out;
  };
  at::Tensor out;
  {
    CommDebugMode mode;
    out = dtensor::context_parallel_attention(q, k, v, mesh, layout, opts);
    c.fwd = mode.comm_counts();
    c.fwd_bytes = bytes(mode);
  }
  {
    CommDebugMode mode;
    out.sum().backward();
    c.bwd = mode.comm_counts();
    c.bwd_bytes = bytes(mode);
  }
  return c;
}

} // namespace

TEST_CASE("cp: every method x layout x mask equals plain attention: every balancer and "
          "documents by cost, causal or not, documents of any length, grouped-query heads",
          "[world2][world4][world8]") {
  DeviceMesh mesh = cp_mesh_of_world();
  // Hierarchical: all-to-all groups of 2 ranks, and of half the ranks (2 x 2 on 4, 4 x 2 on 8).
  std::vector<ContextParallelOptions> methods = {
      ContextParallelOptions().method(CpMethod::AllGather),
      ContextParallelOptions().method(CpMethod::Ring),
      ContextParallelOptions().method(CpMethod::Ulysses),
  };
  for (int64_t u : std::set<int64_t>{2, std::max<int64_t>(world() / 2, 1)}) {
    methods.push_back(ContextParallelOptions().method(CpMethod::Hierarchical).ulysses_degree(u));
  }
  for (ContextParallelOptions opts : methods) {
    for (const Case& c : cases(world())) {
      for (bool causal : {true, false}) {
        for (int64_t kv_heads : std::set<int64_t>{kQHeads, world()}) {
          CpLayout layout(kSeq, world(), c.balance, c.docs);
          INFO(dtensor::name_of(opts.method()) << " (ulysses_degree " << opts.ulysses_degree()
                                               << ") " << layout.describe()
                                               << (causal ? " causal" : "") << " kv_heads "
                                               << kv_heads);
          Inputs in = inputs(kSeq, kv_heads, 17, kQHeads);
          check_equal(run_cp(in, mesh, layout, opts.causal(causal)),
                      reference(in.q, in.k, in.v, in.g, causal, c.docs));
        }
      }
    }
  }
}

TEST_CASE("cp hierarchical counts per call: 2 all-to-alls in the group and cp/u - 1 ring "
          "exchanges forward, 2 and 2(cp/u - 1) backward, exact bytes",
          "[world4][world8]") {
  DeviceMesh mesh = cp_mesh_of_world();
  const int64_t cp = world(), u = 2, ring = cp / u, kv_heads = 4, local = kSeq / cp;
  const int64_t row_bytes = kBatch * local * kDim * 4; // one head's rows on this rank, fp32
  CpLayout layout(kSeq, cp, CpBalance::HeadTail);
  const Inputs in = inputs(kSeq, kv_heads, 3, kQHeads);
  const auto opts = ContextParallelOptions().method(CpMethod::Hierarchical).ulysses_degree(u);
  const CallComms c = comms_of_call(in, mesh, layout, opts);
  // The group's K/V of 1/u of the heads over u ranks' rows: 2 Hkv / u x u rows-of-a-rank.
  const int64_t kv_block = 2 * kv_heads * row_bytes;
  const int64_t a2a = (kQHeads + 2 * kv_heads + kQHeads) * row_bytes;
  CHECK(counts_text(c.fwd) == counts_text({{CollectiveKind::AllToAll, 2},
                                           {CollectiveKind::Send, ring - 1},
                                           {CollectiveKind::Recv, ring - 1}}));
  CHECK(c.fwd_bytes.at(CollectiveKind::AllToAll) == a2a);
  CHECK(c.fwd_bytes.at(CollectiveKind::Send) == (ring - 1) * kv_block);
  CHECK(counts_text(c.bwd) == counts_text({{CollectiveKind::AllToAll, 2},
                                           {CollectiveKind::Send, 2 * (ring - 1)},
                                           {CollectiveKind::Recv, 2 * (ring - 1)}}));
  CHECK(c.bwd_bytes.at(CollectiveKind::AllToAll) == a2a);
  CHECK(c.bwd_bytes.at(CollectiveKind::Send) == 2 * (ring - 1) * kv_block);
  const at::Tensor q = dtensor::cp_shard(in.q, 2, layout, mesh);
  const at::Tensor k = dtensor::cp_shard(in.k, 2, layout, mesh);
  const at::Tensor v = dtensor::cp_shard(in.v, 2, layout, mesh);
  REQUIRE_THROWS_WITH(
      dtensor::context_parallel_attention(
          q, k, v, mesh, layout,
          ContextParallelOptions().method(CpMethod::Hierarchical).ulysses_degree(3)),
      contains("ulysses_degree 3 must divide cp = " + std::to_string(cp)));
}

TEST_CASE("cp Ulysses counts per call: 2 all-to-alls forward (q/k/v, output), 2 backward, "
          "exact bytes; head counts cp does not divide refused",
          "[world2][world4][world8]") {
  DeviceMesh mesh = cp_mesh_of_world();
  const int64_t cp = world(), kv_heads = world(), local = kSeq / cp;
  const int64_t row_bytes = kBatch * local * kDim * 4; // one head's rows on this rank, fp32
  CpLayout layout(kSeq, cp, CpBalance::HeadTail);
  const Inputs in = inputs(kSeq, kv_heads, 3, kQHeads);
  const auto ulysses = ContextParallelOptions().method(CpMethod::Ulysses);
  const CallComms c = comms_of_call(in, mesh, layout, ulysses);
  // q, k and v of every head in one all-to-all, the output in the other; backward the same.
  const int64_t want = (kQHeads + 2 * kv_heads + kQHeads) * row_bytes;
  CHECK(counts_text(c.fwd) == counts_text({{CollectiveKind::AllToAll, 2}}));
  CHECK(c.fwd_bytes.at(CollectiveKind::AllToAll) == want);
  CHECK(counts_text(c.bwd) == counts_text({{CollectiveKind::AllToAll, 2}}));
  CHECK(c.bwd_bytes.at(CollectiveKind::AllToAll) == want);

  // One key / value head (grouped-query attention's extreme): not a multiple of cp.
  const Inputs odd = inputs(kSeq, 1, 5, kQHeads);
  REQUIRE_THROWS_WITH(
      dtensor::context_parallel_attention(dtensor::cp_shard(odd.q, 2, layout, mesh),
                                          dtensor::cp_shard(odd.k, 2, layout, mesh),
                                          dtensor::cp_shard(odd.v, 2, layout, mesh), mesh, layout,
                                          ulysses),
      contains("8 query heads and 1 key / value heads (this rank's, after tensor parallelism) "
               "must both be multiples of cp = " +
               std::to_string(cp)));
}

namespace {

// One phase per pass of `step` under a StepRecorder: forward, backward.
template <typename F>
dtensor::RankReport recorded(F&& step) {
  dtensor::StepRecorder rec;
  rec.phase("forward");
  at::Tensor out = step();
  rec.phase("backward");
  out.sum().backward();
  return rec.finish({}, nullptr);
}

} // namespace

TEST_CASE("cp in the planner: every method's attention work is plain causal attention's over "
          "cp; the ring's transfers stamped between its blocks",
          "[world2][world4][world8]") {
  DeviceMesh mesh = cp_mesh_of_world();
  const int64_t cp = world();
  const Inputs in = inputs(kSeq, kQHeads, 9, kQHeads);
  // The judge: one causal kernel over the whole sequence on this process. FlopCounterMode's
  // count is 4 b h s^2 d forward; the kernel's work the lower triangle, (s + 1) / 2s of it.
  const auto plain = recorded([&] {
    return at::scaled_dot_product_attention(in.q.clone().requires_grad_(), in.k, in.v, {}, 0.0,
                                            /*is_causal=*/true);
  });
  REQUIRE(plain.phases.size() == 2);
  CHECK(plain.phases[0].flops == 4 * kBatch * kQHeads * kSeq * kSeq * kDim);
  CHECK(plain.phases[0].work_flops == 2 * kBatch * kQHeads * kSeq * (kSeq + 1) * kDim);
  CHECK(plain.phases[1].work_flops == 2 * plain.phases[0].work_flops);
  std::vector<ContextParallelOptions> methods = {
      ContextParallelOptions().method(CpMethod::AllGather),
      ContextParallelOptions().method(CpMethod::Ring),
      ContextParallelOptions().method(CpMethod::Ulysses)};
  if (cp >= 4) {
    methods.push_back(ContextParallelOptions().method(CpMethod::Hierarchical).ulysses_degree(2));
  }
  const CpLayout layout(kSeq, cp, CpBalance::HeadTail);
  for (const auto& opts : methods) {
    INFO(dtensor::name_of(opts.method()));
    const auto r = recorded([&] {
      return dtensor::context_parallel_attention(
          dtensor::cp_shard(in.q, 2, layout, mesh).requires_grad_(),
          dtensor::cp_shard(in.k, 2, layout, mesh).requires_grad_(),
          dtensor::cp_shard(in.v, 2, layout, mesh).requires_grad_(), mesh, layout, opts);
    });
    // Head-tail gives every rank the same share of the causal pairs.
    CHECK(r.phases[0].work_flops * cp == plain.phases[0].work_flops);
    CHECK(r.phases[1].work_flops * cp == plain.phases[1].work_flops);
    if (opts.method() == CpMethod::Ring) { // cp - 1 steps, each posted before its block
      std::vector<int64_t> at;
      for (const auto& c : r.phases[0].collectives) {
        if (c.kind == CollectiveKind::Send) {
          at.push_back(c.issued_at);
        }
      }
      REQUIRE(static_cast<int64_t>(at.size()) == cp - 1);
      CHECK(at.front() == 0);
      CHECK(std::is_sorted(at.begin(), at.end()));
      CHECK(std::adjacent_find(at.begin(), at.end()) == at.end()); // strictly increasing
      CHECK(at.back() < r.phases[0].work_flops);
    }
  }
}

TEST_CASE("time model: a timeline of issue points, a stream per group, full-duplex receives",
          "[world2]") {
  using dtensor::CollectiveRecord;
  // 1 TFLOP/s, 1 GB/s, no latency: 1e12 FLOPs take 1 s, 1e9 bytes 1 s on a link.
  const auto o = dtensor::TimeModelOptions()
                     .achieved_tflops(1)
                     .intra_node_gbps(1)
                     .intra_node_latency_us(0);
  const auto record = [](CollectiveKind kind, int64_t bytes, bool async, int64_t at) {
    CollectiveRecord c;
    c.kind = kind;
    c.group = "g";
    c.ranks = {0, 1};
    c.bytes_in = c.bytes_out = bytes;
    c.async = async;
    c.issued_at = at;
    return c;
  };
  // How far the phase's predicted seconds are from `want`.
  const auto off = [&](std::vector<CollectiveRecord> cs, double want) {
    dtensor::RankReport r;
    r.phases.push_back({"p", std::move(cs), 0, 0, 1'000'000'000'000});
    return std::abs(dtensor::predict_step_time(r, o).total_s - want);
  };
  // A ring: 2 s transfers posted at 0 s and 0.5 s of a 1 s phase. The second step waits for
  // the first (until 2 s), its transfer ends at 4 s; the receives cost nothing more.
  CHECK(off({record(CollectiveKind::Recv, 2'000'000'000, true, 0),
              record(CollectiveKind::Send, 2'000'000'000, true, 0),
              record(CollectiveKind::Recv, 2'000'000'000, true, 500'000'000'000),
              record(CollectiveKind::Send, 2'000'000'000, true, 500'000'000'000)}, 4.0) < 1e-9);
  // A prefetched all-gather of 0.5 s (half of 1e9 gathered bytes) hides under the 1 s.
  CHECK(off({record(CollectiveKind::AllGather, 1'000'000'000, true, 0)}, 1.0) < 1e-9);
  // A synchronous all-reduce of 1 s (twice half of 1e9) stalls compute: 2 s.
  CHECK(off({record(CollectiveKind::AllReduce, 1'000'000'000, false, 500'000'000'000)}, 2.0) <
        1e-9);
  // Two asynchronous all-gathers of 0.75 s each in one group queue on its stream: 1.5 s.
  CHECK(off({record(CollectiveKind::AllGather, 1'500'000'000, true, 0),
              record(CollectiveKind::AllGather, 1'500'000'000, true, 0)}, 1.5) < 1e-9);
  // Waits recorded ([Note: waits on the timeline]): the 0.5 s all-gather waited for at 0.25 s
  // stalls compute until 0.5 s, then 0.75 s of compute remain: 1.25 s. Waited at 0.75 s it
  // hides: 1 s.
  auto waited = record(CollectiveKind::AllGather, 1'000'000'000, true, 0);
  waited.waited_at = 250'000'000'000;
  CHECK(off({waited}, 1.25) < 1e-9);
  waited.waited_at = 750'000'000'000;
  CHECK(off({waited}, 1.0) < 1e-9);
  // The next of its kind does not wait for one whose wait is recorded: two 0.5 s all-gathers
  // issued at 0 s and 0.1 s queue on the stream (done at 0.5 s and 1 s); both waited at
  // 0.9 s, compute stalls there until 1 s and has 0.1 s left: 1.1 s (waiting for the first
  // at 0.1 s, as without waits, would give 1.4 s).
  auto second = record(CollectiveKind::AllGather, 1'000'000'000, true, 100'000'000'000);
  waited.waited_at = -1;
  CHECK(off({waited, second}, 1.4) < 1e-9);
  waited.waited_at = second.waited_at = 900'000'000'000;
  CHECK(off({waited, second}, 1.1) < 1e-9);
}

// Guards [Note: waits on the timeline]: an asynchronous collective's record carries the work
// done on its thread when it was waited for; a synchronous one, and one waited after its
// phase, carry none.
TEST_CASE("a recorded asynchronous collective is stamped with its wait", "[world2]") {
  const dtensor::Group group = cp_mesh_of_world().get_group();
  const auto async = dtensor::CollectiveOptions().async_op(true);
  at::Tensor a = at::ones({8, 8}), b = at::ones({8, 4}), t = at::ones({4});
  dtensor::StepRecorder rec;
  rec.phase("p");
  at::Tensor first = at::mm(a, b); // 512 FLOPs before the issue
  auto work = dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, group, async);
  at::Tensor second = at::mm(a, b).mm(b.t()); // 512 + 512 more before the wait
  work.wait();
  dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, group); // synchronous
  auto late = dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, group, async);
  const dtensor::RankReport r = rec.finish({}, nullptr);
  late.wait(); // after the phase
  const auto& cs = r.phases.at(0).collectives;
  REQUIRE(cs.size() == 3);
  CHECK(cs[0].issued_at == 512);
  CHECK(cs[0].waited_at == 512 + 1024);
  CHECK(cs[1].waited_at == -1);
  CHECK(cs[2].waited_at == -1);
}
