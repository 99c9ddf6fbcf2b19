// Mixture of experts (models/moe/moe.h) and expert parallelism (include/dtensor/expert_parallel.h,
// docs/moe.md). Judge: a plain reference written here from the layer's definition (per token:
// fp32 scores, the top-k choice on scores + bias inside the best groups, gates normalised and
// scaled, each chosen expert's SwiGLU as its own matmuls, plus the shared experts), on one
// process with autograd for the gradients.
//  - world1: the layer equals the reference for softmax / sigmoid, route_norm and route_scale,
//    node-limited groups, shared experts, top-k 1, 2 and E, the grouped kernel and the per-expert
//    loop (unaligned sizes); the bias update equals its formula.
//  - world2 / world4 (ep = world, each rank its own tokens): outputs and every gradient equal the
//    reference on the whole batch; per call exactly 3 all-to-alls forward (counts, rows, rows
//    back) and 2 backward, with their bytes; every row to one rank's experts, a rank with no
//    tokens, top-k = E: exact, no hang; the counts exchange started by the router hook; the
//    bias update's one all-reduce; experts that do not divide over ep refused, naming them.
//  - world4: a DeepSeek-V3-style model (a dense block, then an MoE block: sigmoid scores in
//    groups, a shared expert, route scale) and the tiny Qwen3-MoE (q / k norms) under
//    parallelize_llama3 (dp_shard 4 with ep 2 x efsdp 2; dp_shard 2 x tp 2 with ep 4, and
//    with ep 2 x efsdp 2) equal the plain model on one process: logits and every parameter's
//    gradient; 3 + 2 all-to-alls per MoE layer.
//  - world4 with context parallelism (cp 2 x tp 2 with ep 4; dp_shard 2 x cp 2 with ep 2 x
//    efsdp 2): the same judge, the cp ranks holding head-tail chunks of their rows.
//  - world8: dp_shard 4 x tp 2 with ep 4 x efsdp 2 and with ep 8, the same judge.
//  - world1 also: export_hf's refusals of what Qwen3MoeForCausalLM cannot hold.
#include <filesystem>

#include <torch/nn/modules/container/sequential.h>

#include <dtensor/context_parallel.h>
#include <dtensor/expert_parallel.h>

#include <models/llama3.h>
#include <models/moe/load_balance.h>
#include <models/moe/moe.h>
#include <models/moe/parallelize.h>

#include "support/moe_reference.h"

using namespace moe_test; // NOLINT(google-build-using-namespace): the shared judge

TEST_CASE("MoE layer equals its definition: scores, routing, groups, shared experts, top-k, "
          "grouped kernel and per-expert loop",
          "[world1]") {
  struct Case {
    const char* what;
    MoEArgs args;
  };
  const std::vector<Case> cases = {
      {"softmax top-2", small()},
      {"sigmoid, route_norm, scale 2.5",
       small().score_func(MoEScore::Sigmoid).route_norm(true).route_scale(2.5)},
      {"groups 4, 2 chosen, shared 2",
       small().num_expert_groups(4).num_limited_groups(2).num_shared_experts(2)},
      {"top-1", small().top_k(1)},
      {"top-k = E", small().top_k(8).route_norm(true)},
      {"no bias", small().load_balance_coeff(std::nullopt)},
      {"unaligned sizes: the per-expert loop",
       MoEArgs().dim(6).hidden_dim(5).num_experts(4).top_k(2)},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    MoE m = make_moe(c.args, 5);
    if (m->expert_bias.defined()) {
      at::manual_seed(1);
      m->expert_bias.copy_(at::randn({c.args.num_experts()}) * 0.05);
    }
    at::manual_seed(2);
    at::Tensor x = at::randn({2, 8, c.args.dim()});
    at::Tensor g = at::randn({16, c.args.dim()});
    at::Tensor xl = x.clone().requires_grad_();
    at::Tensor out = m->forward(xl);
    (out.view({16, -1}) * g).sum().backward();
    std::vector<at::Tensor> shared_grads;
    if (m->shared_experts) {
      for (const auto& p : m->shared_experts->parameters()) {
        shared_grads.push_back(p.grad().clone());
      }
    }
    Reference r = run_reference(*m, x.view({16, -1}), g);
    CHECK(near(out.view({16, -1}), r.out));
    CHECK(near(xl.grad().view({16, -1}), r.x.grad()));
    CHECK(near(m->router->gate->weight.grad(), r.gate.grad()));
    CHECK(near(m->experts->w1.grad(), r.w1.grad()));
    CHECK(near(m->experts->w2.grad(), r.w2.grad()));
    CHECK(near(m->experts->w3.grad(), r.w3.grad()));
    if (m->shared_experts) {
      size_t i = 0;
      for (const auto& p : m->shared_experts->parameters()) {
        CHECK(near(shared_grads[i++], p.grad()));
      }
    }
    // Training: the rows per expert were counted (T * K of them).
    if (m->expert_bias.defined()) {
      CHECK(m->tokens_per_expert.sum().item<double>() == 16.0 * c.args.top_k());
    }
  }
}

TEST_CASE("MoE load balancing: bias moved by coeff * sign(mean - count), mean-centred; "
          "selection changes, scores do not",
          "[world1]") {
  MoE m = make_moe(small(), 7);
  dtensor::models::ExpertBiasUpdate update(*m);
  REQUIRE(update.layers() == 1);
  at::manual_seed(3);
  m->forward(at::randn({32, 16}));
  m->forward(at::randn({32, 16}));
  at::Tensor c = m->tokens_per_expert.clone();
  CHECK(c.sum().item<double>() == 2 * 32 * 2);
  update.start(std::nullopt);
  CHECK(!m->tokens_per_expert.defined()); // counting restarts
  update.finish();
  at::Tensor delta = 1e-3 * at::sign(c.mean() - c);
  CHECK(at::allclose(m->expert_bias, delta - delta.mean()));
  CHECK(std::abs(m->expert_bias.sum().item<double>()) < 1e-9);
}

TEST_CASE("expert parallelism equals the plain layer: outputs, every gradient, the bias update; "
          "3 all-to-alls forward and 2 backward per call, exact bytes",
          "[world2][world4]") {
  const int64_t d = 16, e = 8, k = 2;
  const std::vector<int64_t> rows_of(static_cast<size_t>(world()), 12);
  for (bool early : {false, true}) {
    for (int64_t shared : {0, 1}) {
      INFO((early ? "router hook" : "no router hook") << ", shared experts " << shared);
      EpRun run = check_ep(small(e).num_shared_experts(shared), rows_of, early);
      CHECK(run.fwd == a2a(3));
      CHECK(run.bwd == a2a(2));
      // Counts (E int64s), this rank's rows out (T*K x D fp32), the received rows back.
      CHECK(run.fwd_bytes == e * 8 + 12 * k * d * 4 + run.received * d * 4);
      CHECK(run.bwd_bytes == 12 * k * d * 4 + run.received * d * 4);
    }
  }
}

TEST_CASE("expert parallelism, skewed routing: every row to rank 0's experts, a rank with no "
          "tokens, top-k = E: exact, no hang, no NaN",
          "[world2][world4]") {
  const int64_t d = 16;
  const std::vector<int64_t> even(static_cast<size_t>(world()), 8);
  SECTION("every row to experts 0 and 1 (rank 0's): the other ranks' experts get none") {
    EpRun run = check_ep(small(), even, true,
                         [](MoEImpl& m) { m.expert_bias.narrow(0, 0, 2).fill_(100.0); });
    CHECK(run.received == (rank() == 0 ? world() * 8 * 2 : 0));
    CHECK(run.fwd == a2a(3));
  }
  SECTION("rank 1 holds no tokens") {
    std::vector<int64_t> rows = even;
    rows[1] = 0;
    EpRun run = check_ep(small().num_shared_experts(1), rows, true);
    CHECK(run.fwd == a2a(3));
    CHECK(run.bwd == a2a(2));
  }
  SECTION("top-k = E: every row to every expert") {
    EpRun run = check_ep(small().top_k(8).route_norm(true), even, false);
    CHECK(run.received == world() * 8 * (8 / world()));
    CHECK(run.fwd_bytes == 8 * 8 + 8 * 8 * d * 4 + run.received * d * 4);
  }
}

// Guards against routers drifting apart silently: with ExpertParallel and no data-parallel
// wrapper over the ep ranks, each rank's router gradient covers its own tokens only. The
// router's first call refuses the layout on every rank, before any exchange starts.
TEST_CASE("ExpertParallel refuses a router whose gradients no data-parallel wrapper reduces "
          "over the ep ranks",
          "[world2]") {
  DeviceMesh mesh = ep_mesh_of_world();
  MoE m = make_moe(small(), 9);
  ExpertParallel style;
  style.apply(*m->experts, mesh);
  style.apply_router(*m->router, mesh);
  at::manual_seed(4 + rank());
  const at::Tensor x = at::randn({8, small().dim()});
  CommDebugMode mode;
  REQUIRE_THROWS_WITH(dtensor::call(m, x),
                      Catch::Matchers::Contains("ExpertParallel on router") &&
                          Catch::Matchers::Contains("parameters [gate.weight] are not reduced "
                                                    "over the ep ranks [0, 1]"));
  CHECK(mode.total_count() == 0);
  // Under replicate over the same ranks the layer runs.
  dtensor::ReplicateHandle ddp = dtensor::replicate(*m->router, mesh);
  CHECK(dtensor::call(m, x).size(0) == 8);
  // Experts a Sequential would call (bypassing the seam where the style acts): the plan is
  // refused before any entry applies ([Note: children of a Sequential]).
  torch::nn::Sequential seq(make_moe(small(), 9)->experts);
  CHECK_THROWS_WITH(dtensor::parallelize_module(*seq, mesh, {{"0", ExpertParallel()}}),
                    Catch::Matchers::Contains("'0' (ExpertParallel for plan entry '0') is called "
                                              "by a torch::nn::Sequential"));
  CHECK(!dtensor::is_dtensor(seq[0]->parameters()[0]));
}

TEST_CASE("ExpertParallel refuses experts that do not divide over ep, and a mesh that is not 1-D, "
          "naming them",
          "[world2][world4]") {
  DeviceMesh mesh = ep_mesh_of_world();
  MoE m = make_moe(small(world() + 1), 1);
  const std::string e = std::to_string(world() + 1);
  const std::string want = "ExpertParallel on " + m->experts->name() + ": parameter 'w1' [" + e +
                           ", 8, 16] has " + e + " experts (dim 0), not a multiple of the " +
                           std::to_string(world()) + " ranks of the expert-parallel mesh";
  REQUIRE_THROWS_WITH(ExpertParallel().apply(*m->experts, mesh), Catch::Matchers::Contains(want));
  CHECK(!dtensor::is_dtensor(m->experts->w1)); // nothing half-done
  DeviceMesh two = init_device_mesh(device_type(), {2, world() / 2}, {"a", "b"});
  REQUIRE_THROWS_WITH(ExpertParallel().apply(*make_moe(small(), 1)->experts, two),
                      Catch::Matchers::Contains("the expert-parallel mesh must be 1-D"));
}

namespace {

// The layer on 4 ranks with experts over the sparse mesh (efsdp x ep) and fully_shard, the
// rest fully_shard over the dense mesh; against the reference on the whole batch.
void check_ep_fsdp(const MoEArgs& a, int64_t ep, const Placements& expert_placements) {
  DeviceMesh dense = init_device_mesh(device_type(), {4}, {"dp"});
  DeviceMesh sparse = dtensor::models::moe_sparse_mesh(dense, ep);
  MoE plain = make_moe(a, 9);
  MoE m = make_moe(a, 9);
  dtensor::models::apply_ep(m, sparse);
  dtensor::models::fully_shard_experts(m, sparse, FullyShardOptions(), /*dp_degree=*/4);
  dtensor::fully_shard(*m, FullyShardOptions().mesh(dense));
  CHECK(DTensor(m->experts->w1).placements() == expert_placements);
  const int64_t rows = 12;
  at::manual_seed(4);
  at::Tensor x = at::randn({4 * rows, a.dim()});
  at::Tensor g = at::randn({4 * rows, a.dim()});
  at::Tensor xl = x.narrow(0, rank() * rows, rows).clone().requires_grad_();
  CommDebugMode mode;
  at::Tensor out = dtensor::call(m, xl);
  (out * g.narrow(0, rank() * rows, rows)).sum().backward();
  // Per module: the counts exchange in the router's call, dispatch and combine in the
  // experts', both backward all-to-alls in the experts' too.
  for (const auto& [name, c] : mode.comm_module_counts()) {
    INFO(name);
    const auto count = [](const std::map<CollectiveKind, int64_t>& k) {
      return k.count(CollectiveKind::AllToAll) != 0 ? k.at(CollectiveKind::AllToAll) : 0;
    };
    if (name.size() > 8 && name.substr(name.size() - 8) == ".experts") {
      CHECK(count(c.forward) == 2);
      CHECK(count(c.backward) == 2);
    } else if (name.size() > 7 && name.substr(name.size() - 7) == ".router") {
      CHECK(count(c.forward) == 1);
      CHECK(count(c.backward) == 0);
    } else if (name == "Global") {
      CHECK(count(c.forward) == 3);
      CHECK(count(c.backward) == 2);
    }
  }
  Reference r = run_reference(*plain, x, g);
  CHECK(near(out, r.out.narrow(0, rank() * rows, rows)));
  CHECK(near(xl.grad(), r.x.grad().narrow(0, rank() * rows, rows)));
  auto whole = [](const at::Tensor& grad) { return full_value(grad) * 4.0; };
  CHECK(near(whole(m->experts->w1.grad()), r.w1.grad()));
  CHECK(near(whole(m->experts->w2.grad()), r.w2.grad()));
  CHECK(near(whole(m->experts->w3.grad()), r.w3.grad()));
  CHECK(near(whole(m->router->gate->weight.grad()), r.gate.grad()));
  auto ps = m->shared_experts->parameters();
  auto qs = plain->shared_experts->parameters();
  for (size_t i = 0; i < ps.size(); ++i) {
    CHECK(near(whole(ps[i].grad()), qs[i].grad()));
  }
}

} // namespace

TEST_CASE("expert parallelism under fully_shard: experts over efsdp x ep on the dense ranks, "
          "the rest over all 4; outputs and every gradient equal the plain layer's; per-module "
          "all-to-alls; an ep that does not divide the dense region refused",
          "[world4]") {
  using dtensor::Shard;
  SECTION("efsdp 2 x ep 2, 8 experts: Shard(0) by expert on both") {
    check_ep_fsdp(small().num_shared_experts(1), 2, Placements{Shard(0), Shard(0)});
  }
  SECTION("efsdp 2 x ep 2, 2 experts: one expert per ep rank, its rows over efsdp (Shard(1))") {
    check_ep_fsdp(small(2).num_shared_experts(1), 2, Placements{Shard(0), Shard(1)});
  }
  SECTION("efsdp 1 x ep 4") {
    check_ep_fsdp(small().num_shared_experts(1), 4, Placements{Shard(0), Shard(0)});
  }
  SECTION("ep 3 on 4 dense ranks") {
    DeviceMesh dense = init_device_mesh(device_type(), {4}, {"dp"});
    REQUIRE_THROWS_WITH(dtensor::models::moe_sparse_mesh(dense, 3),
                        Catch::Matchers::Contains(
                            "MoE expert parallelism: ep 3 does not divide the dense region's 4 "
                            "ranks"));
  }
}

namespace {

// DeepSeek-V3's routing (models/llama3/args.h, deepseek_v3_small_args) at a test's size.
dtensor::models::Llama3Args small_deepseek() {
  return dtensor::models::deepseek_v3_small_args()
      .dim(32)
      .n_layers(2)
      .n_heads(4)
      .n_kv_heads(4)
      .attention_head_dim(8)
      .vocab_size(64)
      .ffn_hidden(48)
      .max_seq_len(8)
      .moe(MoEArgs()
               .hidden_dim(16)
               .num_experts(8)
               .top_k(2)
               .num_shared_experts(1)
               .score_func(MoEScore::Sigmoid)
               .num_expert_groups(4)
               .num_limited_groups(2)
               .route_norm(true)
               .route_scale(2.5));
}

dtensor::models::Llama3 seeded_model(const dtensor::models::Llama3Args& a, const DeviceMesh* mesh,
                                     int64_t ep,
                                     const std::optional<dtensor::ContextParallel>& cp = {}) {
  dtensor::models::Llama3 model(a);
  if (mesh != nullptr) {
    dtensor::models::parallelize_llama3(model, *mesh, /*loss_parallel=*/false, {}, std::nullopt, cp,
                                        ep);
  }
  dtensor::set_rng_state({true, 21, 0});
  model->init_weights();
  return model;
}

// The model under parallelize_llama3 on a (dp_replicate, dp_shard, tp) mesh of `shape`, or
// with four entries a (dp_replicate, dp_shard, cp, tp) mesh with context parallelism (head-tail
// chunks), with `ep`: each data-parallel rank its rows of one batch (tp ranks the same rows,
// cp ranks their chunks of them), against the plain model on the whole batch: logits, every
// parameter's gradient (the loss summed per rank, the plain one divided by the number of
// ranks holding different tokens, dp x cp), 3 + 2 all-to-alls per MoE layer.
void check_model(const dtensor::models::Llama3Args& a, std::vector<int64_t> shape, int64_t ep) {
  const bool with_cp = shape.size() == 4;
  const DeviceMesh mesh =
      with_cp ? init_device_mesh(device_type(), shape, {"dp_replicate", "dp_shard", "cp", "tp"})
              : init_device_mesh(device_type(), shape, {"dp_replicate", "dp_shard", "tp"});
  std::optional<dtensor::ContextParallel> cp;
  if (with_cp) {
    cp.emplace(dtensor::ContextParallelOptions().method(dtensor::CpMethod::AllGather));
  }
  auto plain = seeded_model(a, nullptr, 1);
  auto model = seeded_model(a, &mesh, ep, cp);
  const int64_t dp = shape[0] * shape[1];
  const int64_t seq = 8;
  const int64_t cp_size = with_cp ? shape[2] : 1;
  const int64_t rows = 8 / dp;
  const auto coord = mesh.get_coordinate().value();
  const int64_t first = (coord[0] * shape[1] + coord[1]) * rows;
  // This rank's tokens: its rows, and with cp its head-tail chunks of them.
  std::optional<dtensor::CpLayout> layout;
  auto mine = [&](const at::Tensor& full) {
    const at::Tensor r = full.narrow(0, first, rows);
    return layout ? dtensor::cp_shard(r, 1, *layout, mesh["cp"]) : r;
  };
  if (with_cp) {
    layout.emplace(seq, cp_size, dtensor::CpBalance::HeadTail);
    cp->set_layout(*layout);
  }
  at::manual_seed(3);
  const at::Tensor tokens = at::randint(a.vocab_size(), {8, seq}, at::kLong);
  const at::Tensor g = at::randn({8, seq, a.vocab_size()});
  CommDebugMode mode;
  at::Tensor logits = dtensor::call(model, mine(tokens));
  (logits * mine(g)).sum().backward();
  const auto counts = mode.comm_module_counts().at("Global");
  const int64_t moe_layers = a.n_layers() - a.n_dense_layers();
  CHECK(counts.forward.at(CollectiveKind::AllToAll) == 3 * moe_layers);
  CHECK(counts.backward.at(CollectiveKind::AllToAll) == 2 * moe_layers);
  at::Tensor want = dtensor::call(plain, tokens);
  ((want * g).sum() / static_cast<double>(dp * cp_size)).backward();
  REQUIRE(!dtensor::is_dtensor(logits));
  CHECK(near(logits, mine(want)));
  auto theirs = plain->named_parameters();
  int64_t compared = 0;
  for (const auto& item : model->named_parameters()) {
    INFO(item.key());
    CHECK(near(full_value(item.value().grad()), theirs[item.key()].grad()));
    ++compared;
  }
  CHECK(compared == static_cast<int64_t>(theirs.size()));
}

} // namespace

// Guards the model-level composition: parallelize_llama3's apply_moe (ExpertParallel, the
// experts' own fully_shard on the sparse mesh, and with tp > 1 the router and shared experts
// as a unit over dp_shard x tp: [Note: token-parallel units under tensor parallelism]; the
// q / k norms on heads sharded by tp), the MoE layer's sequence-parallel boundary
// (PrepareModuleInput / PrepareModuleOutput on a module without TP parameters) and the block's moe
// path.
TEST_CASE("MoE models under parallelize_llama3 equal the plain model: logits, every gradient, "
          "3 + 2 all-to-alls per MoE layer; FSDP x EP, and TP on the dense part",
          "[world4]") {
  SECTION("DeepSeek-V3-style, dp_shard 4; experts ep 2 x efsdp 2") {
    check_model(small_deepseek(), {1, 4, 1}, 2);
  }
  SECTION("DeepSeek-V3-style, dp_shard 2 x tp 2; experts ep 4 (borrowing tp)") {
    check_model(small_deepseek(), {1, 2, 2}, 4);
  }
  SECTION("Qwen3-MoE (q / k norms), dp_shard 2 x tp 2; experts ep 2 x efsdp 2") {
    check_model(dtensor::models::qwen3_moe_tiny_args().max_seq_len(8), {1, 2, 2}, 2);
  }
}

// Guards MoE layers with context parallelism: the cp ranks' head-tail chunks route like any
// other tokens; ep borrows cp's ranks (and tp's); the experts' gradients divided by dp x cp, the
// router's unit over dp_shard x cp x tp when tp > 1 ([Note: token-parallel units under tensor
// parallelism]).
TEST_CASE("MoE models with context parallelism equal the plain model: cp 2 x tp 2 with ep 4, "
          "dp_shard 2 x cp 2 with ep 2 x efsdp 2",
          "[world4]") {
  SECTION("DeepSeek-V3-style, cp 2 x tp 2; experts ep 4 (borrowing cp and tp)") {
    check_model(small_deepseek(), {1, 1, 2, 2}, 4);
  }
  SECTION("Qwen3-MoE, dp_shard 2 x cp 2; experts ep 2 x efsdp 2") {
    check_model(dtensor::models::qwen3_moe_tiny_args().max_seq_len(8), {1, 2, 2, 1}, 2);
  }
}

// The 8-rank layouts: dense dp_shard 4 x tp 2 with the experts over ep 4 x efsdp 2,
// and over ep 8 (one expert a rank, no efsdp).
TEST_CASE("MoE models on 8 ranks: dp_shard 4 x tp 2 with ep 4 x efsdp 2 and with ep 8 equal the "
          "plain model",
          "[world8]") {
  SECTION("Qwen3-MoE, ep 4 x efsdp 2") {
    check_model(dtensor::models::qwen3_moe_tiny_args().max_seq_len(8), {1, 4, 2}, 4);
  }
  SECTION("DeepSeek-V3-style, ep 8") {
    check_model(small_deepseek(), {1, 4, 2}, 8);
  }
}

// Guards export_hf's refusals: what Qwen3MoeForCausalLM cannot hold (DeepSeek-V3's routing,
// a trained load-balancing bias) is refused by name before anything is written.
TEST_CASE("export_hf refuses attention without q / k norms, sigmoid groups, shared experts and "
          "a non-zero bias, writing nothing",
          "[world1]") {
  namespace fs = std::filesystem;
  const std::string dir = dtensor::testing::fresh_shared_dir("moe-tests", "refused-export");
  auto plain_attention = seeded_model(small_deepseek(), nullptr, 1);
  REQUIRE_THROWS_WITH(dtensor::models::export_hf(plain_attention, dir),
                      Catch::Matchers::Contains("whose attention has q / k norms: set qk_norm"));
  auto deepseek = seeded_model(small_deepseek().qk_norm(true), nullptr, 1);
  REQUIRE_THROWS_WITH(dtensor::models::export_hf(deepseek, dir),
                      Catch::Matchers::Contains(
                          "Qwen3MoeForCausalLM routes by softmax over all experts with no shared "
                          "experts, groups or route scale; this model has sigmoid scores, 1 shared "
                          "experts, 4 groups, route scale 2.5"));
  CHECK(!fs::exists(dir));
  auto qwen = seeded_model(dtensor::models::qwen3_moe_tiny_args(), nullptr, 1);
  qwen->layers[1]->as<dtensor::models::Llama3BlockImpl>()->moe->expert_bias.fill_(0.5);
  REQUIRE_THROWS_WITH(dtensor::models::export_hf(qwen, dir),
                      Catch::Matchers::Contains("layers.1.moe.expert_bias is not zero"));
  CHECK(!fs::exists(dir));
}
