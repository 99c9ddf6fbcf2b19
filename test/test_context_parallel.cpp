// Context parallelism (include/dtensor/context_parallel.h, docs/context_parallel.md): attention
// over a sequence sharded across the cp ranks equals plain attention on the whole sequence on
// one process (outputs, log-sum-exp, dq / dk / dv; fp32, atol 2e-6, rtol 1e-5 as PyTorch's own
// CP tests), for both methods, causal or not, every balancer, grouped-query head counts and
// document masks (one, several, uneven, per row); each call's collectives counted exactly
// with their bytes; the ring's K/V memory O(S/cp); bad input refused on every rank with the
// numbers named. On one process the block engine alone plays every rank of cp 2, 4 and 8.
#include <algorithm>
#include <limits>
#include <numeric>

#include <torch/nn/modules/linear.h>

#include <dtensor/context_parallel.h>

#include "parallel/cp/blocks.h"
#include "support/cp_reference.h"
#include "support/prelude.h"

using dtensor::ContextParallelOptions;
using dtensor::CpBalance;
using dtensor::CpLayout;
using dtensor::CpMethod;

namespace {

using namespace cp_test;

struct LayoutCase {
  CpBalance balance;
  Docs docs;
};

// Every balancer; one document, several, uneven ones (not per-document: they are not
// multiples of 2cp), a different set per batch row.
std::vector<LayoutCase> layout_cases(int64_t cp) {
  const int64_t c = 2 * cp; // per-document head-tail's unit
  std::vector<LayoutCase> out = {
      {CpBalance::None, {}},
      {CpBalance::HeadTail, {}},
      {CpBalance::PerDocument, {{32}}},
      {CpBalance::PerDocument, {{c, 32 - 3 * c, 2 * c}}},
      {CpBalance::HeadTail, {{5, 19, 8}}},
      {CpBalance::None, {{3, 1, 28}, {16, 16}}},
      {CpBalance::Documents, {{5, 19, 8}}},
      {CpBalance::Documents, {{3, 1, 28}, {16, 16}}},
  };
  return out;
}

} // namespace

TEST_CASE("cp layouts: PyTorch's head-tail order, and lengths a balancer cannot split refused",
          "[world1]") {
  CpLayout two(8, 2, CpBalance::HeadTail);
  CHECK(same(two.positions(0), at::tensor({0, 1, 6, 7}, at::kLong)));
  CHECK(same(two.positions(1), at::tensor({2, 3, 4, 5}, at::kLong)));
  CpLayout four(16, 4, CpBalance::HeadTail);
  at::Tensor all =
      at::cat({four.positions(0), four.positions(1), four.positions(2), four.positions(3)});
  // PyTorch 2.15's _HeadTailLoadBalancer(16, 4)._generate_indices()
  CHECK(same(all, at::tensor({0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9}, at::kLong)));
  CpLayout docs(12, 2, CpBalance::PerDocument, {{8, 4}});
  // ... and _PerDocumentHeadTailLoadBalancer([[8, 4]], 2)
  CHECK(same(at::cat({docs.positions(0), docs.positions(1)}),
             at::tensor({0, 1, 6, 7, 8, 11, 2, 3, 4, 5, 9, 10}, at::kLong)));

  REQUIRE_THROWS_WITH(CpLayout(30, 4, CpBalance::HeadTail),
                      "context_parallel: sequence length 30 is not divisible by 2*cp = 8 "
                      "(head-tail load balancing)");
  REQUIRE_THROWS_WITH(CpLayout(30, 4, CpBalance::None),
                      "context_parallel: sequence length 30 is not divisible by cp = 4");
  REQUIRE_THROWS_WITH(CpLayout(32, 4, CpBalance::PerDocument, {{16, 10, 6}}),
                      "context_parallel: document 1 has length 10, not a multiple of 2*cp = 8 "
                      "(per-document head-tail load balancing)");
  REQUIRE_THROWS_WITH(CpLayout(32, 2, CpBalance::None, {{16, 10}}),
                      "context_parallel: the documents of batch row 0 (16, 10) sum to 26, not to "
                      "the sequence length 32");
  REQUIRE_THROWS_WITH(CpLayout(32, 2, CpBalance::PerDocument, {{16, 16}, {8, 24}}),
                      contains("needs the same documents in every batch row"));
  REQUIRE_THROWS_WITH(CpLayout(36, 4, CpBalance::Documents, {{35, 1}}),
                      contains("sequence length 36 is not divisible by 2*cp = 8 (documents "
                               "balanced by cost"));
}

TEST_CASE("cp documents by cost: head-tail's order without documents, equal rows, causal work "
          "within 10% of the mean for documents of any length",
          "[world1]") {
  // Chunks of 1 row would be finer than 2: one chunk per head-tail chunk, its order exactly.
  for (int64_t cp : {2, 4}) {
    CpLayout by_cost(4 * cp, cp, CpBalance::Documents), head_tail(4 * cp, cp, CpBalance::HeadTail);
    for (int64_t r = 0; r < cp; ++r) {
      CHECK(same(by_cost.positions(r), head_tail.positions(r)));
    }
  }
  // Packed rows of mixed lengths (a different set per row), 4096 rows on cp 4 and 8.
  const Docs docs = {{137, 2041, 89, 1, 1828}, {4000, 96}, {512, 512, 1024, 7, 2041}};
  for (int64_t cp : {4, 8}) {
    CpLayout layout(4096, cp, CpBalance::Documents, docs);
    std::vector<double> work;
    for (int64_t r = 0; r < cp; ++r) {
      const at::Tensor pos = layout.positions(r);
      REQUIRE(pos.numel() == 4096 / cp);
      double w = 0;
      for (const auto& row : docs) { // keys seen by each query under the document mask
        std::vector<int64_t> start(4096);
        int64_t at_ = 0;
        for (int64_t len : row) {
          for (int64_t p = at_; p < at_ + len; ++p) {
            start[static_cast<size_t>(p)] = at_;
          }
          at_ += len;
        }
        for (int64_t i = 0; i < pos.numel(); ++i) {
          const int64_t p = pos[i].item<int64_t>();
          w += static_cast<double>(p - start[static_cast<size_t>(p)] + 1);
        }
      }
      work.push_back(w);
      CHECK(layout.work(r) == static_cast<int64_t>(w)); // the library's count, the same pairs
    }
    const double mean = std::accumulate(work.begin(), work.end(), 0.0) / static_cast<double>(cp);
    const double worst = *std::max_element(work.begin(), work.end());
    INFO("cp " << cp << ": the most loaded rank " << worst / mean << " x the mean");
    CHECK(worst <= 1.10 * mean);
  }
}

TEST_CASE("cp block engine: every rank of cp 2, 4 and 8 played on one process equals plain "
          "attention, empty blocks skipped",
          "[world1]") {
  namespace cp = dtensor::detail::cp;
  for (int64_t world_cp : {2, 4, 8}) {
    for (const LayoutCase& lc : layout_cases(4)) { // 32 rows: every case divides at cp 8 too
      if (lc.balance == CpBalance::PerDocument && world_cp == 8 && lc.docs[0].size() > 1) {
        continue; // documents of 8 and 8 rows: not multiples of 16 (the refusal is tested above)
      }
      for (bool causal : {true, false}) {
        CpLayout layout(32, world_cp, lc.balance, lc.docs);
        INFO(layout.describe() << (causal ? " causal" : ""));
        Inputs in = inputs(32, 2, 7);
        Reference want = reference(in.q, in.k, in.v, in.g, causal, lc.docs);
        const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
        int64_t skipped = 0;
        for (int64_t r = 0; r < world_cp; ++r) {
          at::Tensor q = dtensor::cp_shard(in.q, 2, layout, r);
          cp::Accumulator acc(q);
          for (int64_t s = 0; s < world_cp; ++s) {
            cp::Plan plan = cp::plan_blocks(layout, r, s, kBatch, causal);
            skipped += plan.skipped;
            cp::forward_blocks(acc, plan, q, dtensor::cp_shard(in.k, 2, layout, s),
                               dtensor::cp_shard(in.v, 2, layout, s), scale);
          }
          CHECK(near(acc.out, dtensor::cp_shard(want.out, 2, layout, r)));
          CHECK(near(acc.lse, dtensor::cp_shard(want.lse, 2, layout, r)));
        }
        bool several_docs = false;
        for (const auto& row : lc.docs) {
          several_docs = several_docs || row.size() > 1;
        }
        // Where the mask empties some (query, key) segment pairs, they were not computed.
        CHECK((skipped > 0) == (causal || several_docs));
      }
    }
  }
}

TEST_CASE("cp attention equals plain attention: both methods, causal or not, every balancer, "
          "documents, grouped-query heads",
          "[world2][world4]") {
  DeviceMesh mesh = cp_mesh_of_world();
  for (CpMethod method : {CpMethod::AllGather, CpMethod::Ring}) {
    for (const LayoutCase& lc : layout_cases(world())) {
      for (bool causal : {true, false}) {
        for (int64_t kv_heads : {4, 2, 1}) {
          CpLayout layout(32, world(), lc.balance, lc.docs);
          INFO(dtensor::name_of(method) << " " << layout.describe() << (causal ? " causal" : "")
                                        << " kv_heads " << kv_heads);
          Inputs in = inputs(32, kv_heads, 11);
          check_equal(
              run_cp(in, mesh, layout, ContextParallelOptions().method(method).causal(causal)),
              reference(in.q, in.k, in.v, in.g, causal, lc.docs));
        }
      }
    }
  }
}

TEST_CASE("cp attention counts per call: all-gather 1 AG + 1 RS, ring cp-1 + 2(cp-1) transfers, "
          "exact bytes",
          "[world2][world4]") {
  DeviceMesh mesh = cp_mesh_of_world();
  const int64_t cp = world(), kv_heads = 2, seq = 32, local = seq / cp;
  const int64_t kv_bytes = 2 * kBatch * kv_heads * local * kDim * 4; // K and V, this rank's, fp32
  CpLayout layout(seq, cp, CpBalance::HeadTail);
  Inputs in = inputs(seq, kv_heads, 3);
  for (CpMethod method : {CpMethod::AllGather, CpMethod::Ring}) {
    INFO(dtensor::name_of(method));
    at::Tensor q = dtensor::cp_shard(in.q, 2, layout, mesh).requires_grad_();
    at::Tensor k = dtensor::cp_shard(in.k, 2, layout, mesh).requires_grad_();
    at::Tensor v = dtensor::cp_shard(in.v, 2, layout, mesh).requires_grad_();
    std::string fwd, bwd;
    int64_t fwd_bytes = 0, bwd_bytes = 0;
    const CollectiveKind fwd_kind =
        method == CpMethod::AllGather ? CollectiveKind::AllGather : CollectiveKind::Send;
    const CollectiveKind bwd_kind =
        method == CpMethod::AllGather ? CollectiveKind::ReduceScatter : CollectiveKind::Send;
    at::Tensor out;
    {
      CommDebugMode mode;
      out = dtensor::context_parallel_attention(q, k, v, mesh, layout,
                                                ContextParallelOptions().method(method));
      fwd = counts_text(mode.comm_counts());
      fwd_bytes = mode.bytes_in(fwd_kind);
    }
    {
      CommDebugMode mode;
      out.sum().backward();
      bwd = counts_text(mode.comm_counts());
      bwd_bytes = mode.bytes_in(bwd_kind);
    }
    if (method == CpMethod::AllGather) {
      CHECK(fwd == counts_text({{CollectiveKind::AllGather, 1}}));
      CHECK(fwd_bytes == kv_bytes);
      CHECK(bwd == counts_text({{CollectiveKind::ReduceScatter, 1}}));
      CHECK(bwd_bytes == cp * kv_bytes); // the fp32 dK/dV of the whole sequence
    } else {
      CHECK(fwd == counts_text({{CollectiveKind::Send, cp - 1}, {CollectiveKind::Recv, cp - 1}}));
      CHECK(fwd_bytes == (cp - 1) * kv_bytes);
      CHECK(bwd == counts_text({{CollectiveKind::Send, 2 * (cp - 1)},
                                {CollectiveKind::Recv, 2 * (cp - 1)}}));
      CHECK(bwd_bytes == 2 * (cp - 1) * kv_bytes); // K/V round again, then dK/dV home
    }
  }
}

TEST_CASE("cp all-gather under a document mask: one all-to-all each way, moving only the rows "
          "some query of the receiving rank may attend to",
          "[world2][world4]") {
  // [Note: only the rows a rank needs] in lib/parallel/cp/methods.cpp. What rank r needs of
  // rank s is read off the explicit mask the reference uses, not off the library's block plan.
  DeviceMesh mesh = cp_mesh_of_world();
  const int64_t cp = world(), seq = 32, kv_heads = 2, me = rank();
  const int64_t row_bytes = 2 * kBatch * kv_heads * kDim * 4; // a row of K and V, fp32
  int64_t moved = 0, gathered = 0; // rows this rank sent, and what an all-gather sends
  for (const LayoutCase& lc : layout_cases(cp)) {
    if (lc.docs.empty()) {
      continue; // without documents: one all-gather and one reduce-scatter (above)
    }
    for (bool causal : {true, false}) {
      CpLayout layout(seq, cp, lc.balance, lc.docs);
      INFO(layout.describe() << (causal ? " causal" : ""));
      // [S, S]: may query p attend to key k in some batch row
      const at::Tensor allowed = (mask_of(seq, causal, lc.docs, kBatch).squeeze(1) == 0).any(0);
      auto needed = [&](int64_t r, int64_t s) { // rows of s some query of r attends to
        return allowed.index_select(0, layout.positions(r))
            .index_select(1, layout.positions(s))
            .any(0)
            .sum()
            .item<int64_t>();
      };
      int64_t sends = 0, receives = 0;
      for (int64_t other = 0; other < cp; ++other) {
        if (other != me) {
          sends += needed(other, me);
          receives += needed(me, other);
        }
      }
      Inputs in = inputs(seq, kv_heads, 13);
      auto shard = [&](const at::Tensor& t) {
        return dtensor::cp_shard(t, 2, layout, mesh).requires_grad_();
      };
      at::Tensor q = shard(in.q), k = shard(in.k), v = shard(in.v), out;
      const auto opts = ContextParallelOptions().method(CpMethod::AllGather).causal(causal);
      {
        CommDebugMode mode;
        out = dtensor::context_parallel_attention(q, k, v, mesh, layout, opts);
        CHECK(counts_text(mode.comm_counts()) == counts_text({{CollectiveKind::AllToAll, 1}}));
        CHECK(mode.bytes_in(CollectiveKind::AllToAll) == sends * row_bytes);
      }
      {
        CommDebugMode mode;
        (out * dtensor::cp_shard(in.g, 2, layout, mesh)).sum().backward();
        CHECK(counts_text(mode.comm_counts()) == counts_text({{CollectiveKind::AllToAll, 1}}));
        CHECK(mode.bytes_in(CollectiveKind::AllToAll) == receives * row_bytes); // fp32 dK/dV
      }
      const Reference want = reference(in.q, in.k, in.v, in.g, causal, lc.docs);
      auto whole = [&](const at::Tensor& t) {
        return dtensor::cp_unshard(t.detach(), 2, layout, mesh);
      };
      CHECK(near(whole(out), want.out));
      CHECK(near(whole(k.grad()), want.dk));
      CHECK(near(whole(v.grad()), want.dv));
      moved += sends;
      gathered += (cp - 1) * layout.local_len();
    }
  }
  CHECK(moved < gathered); // the documents leave rows no other rank needs
}

TEST_CASE("cp ring: K/V held per rank O(S/cp), twice the local block at 32 and 64 rows; "
          "all-gather holds the whole sequence's",
          "[world2][world4]") {
  DeviceMesh mesh = cp_mesh_of_world();
  for (int64_t seq : {32, 64}) {
    const int64_t local_kv = 2 * kBatch * 2 * (seq / world()) * kDim * 4;
    for (CpMethod method : {CpMethod::Ring, CpMethod::AllGather}) {
      CpLayout layout(seq, world(), CpBalance::HeadTail);
      Inputs in = inputs(seq, 2, 5);
      dtensor::reset_cp_stats();
      dtensor::context_parallel_attention(dtensor::cp_shard(in.q, 2, layout, mesh),
                                          dtensor::cp_shard(in.k, 2, layout, mesh),
                                          dtensor::cp_shard(in.v, 2, layout, mesh), mesh, layout,
                                          ContextParallelOptions().method(method));
      CHECK(dtensor::cp_stats().peak_kv_bytes ==
            (method == CpMethod::Ring ? 2 : world()) * local_kv);
    }
  }
}

namespace {

struct AttentionImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  }
};
TORCH_MODULE(Attention);

struct MaskedAttentionImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& mask) {
    return at::scaled_dot_product_attention(q, k, v, mask);
  }
};
TORCH_MODULE(MaskedAttention);

} // namespace

TEST_CASE("ContextParallel style on an attention module; a module that is not attention and a "
          "call before set_layout refused on every rank",
          "[world2][world4]") {
  DeviceMesh mesh = cp_mesh_of_world();
  CpLayout layout(32, world(), CpBalance::HeadTail);
  Inputs in = inputs(32, kHeads, 13);
  Attention attention;
  dtensor::ContextParallel style(ContextParallelOptions().method(CpMethod::Ring));
  style.apply(*attention, mesh);
  REQUIRE_THROWS_WITH(dtensor::call(attention, in.q, in.k, in.v),
                      contains("was called before the style's set_layout"));
  style.set_layout(layout);
  MaskedAttention masked;
  style.apply(*masked, mesh);
  at::Tensor out = dtensor::call(attention, dtensor::cp_shard(in.q, 2, layout, mesh),
                                 dtensor::cp_shard(in.k, 2, layout, mesh),
                                 dtensor::cp_shard(in.v, 2, layout, mesh));
  CHECK(near(dtensor::cp_unshard(out, 2, layout, mesh),
             at::scaled_dot_product_attention(in.q, in.k, in.v, {}, 0.0, true)));

  REQUIRE_THROWS_WITH(
      dtensor::call(masked, in.q, in.k, in.v, at::zeros({32, 32})),
      contains("was called with a fourth tensor, an attention mask: context parallelism takes "
               "causal and document masks only"));
  torch::nn::Linear linear(kDim, kDim);
  style.apply(*linear, mesh);
  REQUIRE_THROWS_WITH(dtensor::call(linear, at::ones({2, kDim})),
                      "ContextParallel: module 'torch::nn::LinearImpl' is not attention: its call "
                      "has 1 tensor inputs, the style needs three, q, k and v, each [batch, heads, "
                      "seq, head_dim]");
  // The same refusals on every rank, before any collective.
  REQUIRE_THROWS_WITH(CpLayout(30, world(), CpBalance::HeadTail),
                      contains("sequence length 30 is not divisible by 2*cp"));
  REQUIRE_THROWS_WITH(dtensor::cp_shard(in.q, 2, CpLayout(64, world(), CpBalance::HeadTail), mesh),
                      contains("has 32 rows, but the layout"));
  REQUIRE_THROWS_WITH(
      dtensor::context_parallel_attention(dtensor::cp_shard(in.q, 2, layout, mesh),
                                          dtensor::cp_shard(in.k, 2, layout, mesh).narrow(2, 0, 2),
                                          dtensor::cp_shard(in.v, 2, layout, mesh), mesh, layout),
      contains("do not fit"));
}

TEST_CASE("to_local(grad_placements Partial): a replicated tensor's local gradients summed on "
          "the way back (one reduce-scatter)",
          "[world2][world4]") {
  DeviceMesh mesh = init_device_mesh(device_type(), {world()}, {"x"});
  at::manual_seed(1);
  at::Tensor full = at::rand({world() * 2, 3});
  at::Tensor local = full.chunk(world())[static_cast<size_t>(rank())].clone().requires_grad_();
  DTensor replicated =
      DTensor(DTensor::from_local(local, mesh, {Placement::shard(0)}, full.sizes().vec())
                  .redistribute(mesh, {Placement::replicate()}));
  // Each rank uses the whole tensor with its own weight: the true gradient of the sum over
  // ranks is sum_r (r + 1) = world (world + 1) / 2 for every element.
  std::string counts;
  {
    CommDebugMode mode;
    (replicated.to_local(Placements{Placement::partial()}) * (rank() + 1)).sum().backward();
    counts = counts_text(mode.comm_counts());
  }
  CHECK(same(local.grad(), at::full({2, 3}, world() * (world() + 1) / 2.0)));
  CHECK(counts == counts_text({{CollectiveKind::ReduceScatter, 1}}));
  // Without it the local gradient is read as the whole one: this rank's weight only.
  at::Tensor again = local.detach().clone().requires_grad_();
  (DTensor(DTensor::from_local(again, mesh, {Placement::shard(0)}, full.sizes().vec())
               .redistribute(mesh, {Placement::replicate()}))
       .to_local() *
   (rank() + 1))
      .sum()
      .backward();
  CHECK(same(again.grad(), at::full({2, 3}, static_cast<double>(rank() + 1))));
  REQUIRE_THROWS_WITH(replicated.to_local(Placements{Placement::shard(0)}),
                      contains("to_local(grad_placements): (Shard(0)) do not fit"));
}
