// FSDP x TP on a (dp, tp) mesh: common_fsdp.py's MLPStack.parallelize (tensor parallelism on
// each MLP, sequence parallelism on the final LayerNorm, fully_shard over dp) and a small
// Transformer, trained in parity with a data-parallel reference over dp.
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"
#include <models/fsdp_models.h>
#include <models/mlp_models.h>

using dtensor::testing::near;
using dtensor::testing::parallelize_mlp_stack;

namespace {

// (dp, tp): 2x2 on 4 ranks, 1x2 on 2 (tensor parallelism only), 1x1 on 1.
DeviceMesh mesh_2d() {
  const int64_t tp = world() >= 2 ? 2 : 1;
  return init_device_mesh(device_type(), {world() / tp, tp}, {"dp", "tp"});
}

} // namespace

TEST_CASE("FSDP x TP: MLPStack(16, with_seq_parallel) matches replicate over dp",
          "[fsdp_tp][world1][world2][world4]") {
  auto mesh = mesh_2d();
  auto dp = mesh["dp"];
  auto tp = mesh["tp"];
  for (bool reshard_after_forward : {true, false}) {
    INFO("reshard_after_forward " << reshard_after_forward);
    torch::manual_seed(0);
    auto ref = dtensor::models::mlp_stack(16, true);
    ref->to(options().device());
    auto ref_handle = dtensor::replicate(*ref, dp);
    torch::manual_seed(0);
    auto model = dtensor::models::mlp_stack(16, true);
    model->to(options().device());
    auto units = parallelize_mlp_stack(model, tp, dp, reshard_after_forward);
    // Colwise weights: Shard(0) on tp and, inside each tp shard, Shard(0) on dp.
    auto w = DTensor(model[0]->as<dtensor::models::MLPImpl>()->in_proj->weight);
    REQUIRE(w.device_mesh().dim_names() == std::vector<std::string>{"tp", "dp"});
    REQUIRE(w.placements() == dtensor::Placements{dtensor::Shard(0), dtensor::Shard(0)});
    auto w_out = DTensor(model[0]->as<dtensor::models::MLPImpl>()->out_proj->weight);
    REQUIRE(w_out.placements() == dtensor::Placements{dtensor::Shard(1), dtensor::Shard(0)});
    // The 2-D layout holds the right global values, uneven sizes (x3) included.
    auto q = ref->named_parameters();
    auto p = model->named_parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("initial " << p[i].key());
      REQUIRE(close(full_value(p[i].value()), q[i].value()));
    }
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      at::manual_seed(1000 + 10 * step + dp.get_local_rank(0)); // same input within a dp group
      auto x = at::randn({2, 8, 16}, options());
      opt.zero_grad();
      ref_opt.zero_grad();
      CommDebugMode mode;
      auto out = model->forward(x);
      REQUIRE(DTensor(out).placements() == dtensor::Placements{dtensor::Shard(1)});
      // (A plain sum of LayerNorm outputs is ~0 with flat gradients; squares are not.)
      auto loss = DTensor(out.pow(2).sum()).full_tensor();
      // Forward: 4 all-gathers over dp (3 MLPs + the root's LayerNorm); over tp, one
      // all-reduce per rowwise MLP output (2), one reduce-scatter (the last MLP, into
      // sequence shards), one all-reduce for the loss.
      REQUIRE(mode.count("dp", CollectiveKind::AllGather) == over(dp.size(), 4));
      REQUIRE(mode.count("tp", CollectiveKind::AllReduce) == over(mesh["tp"].size(), 3));
      REQUIRE(mode.count("tp", CollectiveKind::ReduceScatter) == over(mesh["tp"].size(), 1));
      loss.backward();
      REQUIRE(mode.count("dp", CollectiveKind::ReduceScatter) == over(dp.size(), 4));
      auto ref_loss = ref->forward(x).pow(2).sum();
      ref_loss.backward();
      REQUIRE(near(loss, ref_loss));
      for (size_t i = 0; i < p.size(); ++i) {
        INFO("grad " << p[i].key());
        auto g = DTensor(p[i].value().grad());
        REQUIRE(g.placements() == DTensor(p[i].value()).placements());
        REQUIRE(near(full_value(g), q[i].value().grad()));
      }
      opt.step();
      ref_opt.step();
      for (size_t i = 0; i < p.size(); ++i) {
        INFO("param " << p[i].key());
        REQUIRE(near(full_value(p[i].value()), q[i].value()));
      }
    }
    // Full state dict: the right global values; load it back into a fresh copy.
    auto sd =
        dtensor::get_model_state_dict(*model, dtensor::StateDictOptions().full_state_dict(true));
    for (size_t i = 0; i < p.size(); ++i) {
      REQUIRE(near(*sd.find(p[i].key()), q[i].value()));
    }
  }
}

TEST_CASE("FSDP x TP: Transformer with tensor-parallel attention and MLP, each block fully sharded",
          "[fsdp_tp][world1][world2][world4]") {
  auto mesh = mesh_2d();
  auto dp = mesh["dp"];
  auto tp = mesh["tp"];
  using dtensor::ColwiseParallel;
  using dtensor::RowwiseParallel;
  using dtensor::models::Transformer;
  auto args = dtensor::models::ModelArgs().dropout_p(0.0);
  torch::manual_seed(0);
  Transformer ref(args);
  ref->to(options().device());
  auto ref_handle = dtensor::replicate(*ref, dp);
  torch::manual_seed(0);
  Transformer model(args);
  model->to(options().device());
  dtensor::parallelize_module(
      *model, tp,
      dtensor::ParallelizePlan{
          {"layers.*.attention.w[qkv]", ColwiseParallel().use_local_output(false)},
          {"layers.*.attention.wo", RowwiseParallel().use_local_output(false)},
          {"layers.*.feed_forward.w1", ColwiseParallel().use_local_output(false)},
          {"layers.*.feed_forward.w2", RowwiseParallel().use_local_output(false)},
      });
  for (auto& layer : *model->layers) {
    dtensor::fully_shard(*layer, FullyShardOptions().mesh(dp));
  }
  dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto p = model->named_parameters();
  auto q = ref->named_parameters();
  REQUIRE(p.size() == q.size());
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    at::manual_seed(500 + 10 * step + dp.get_local_rank(0)); // same tokens within a dp group
    auto tokens = at::randint(8, {2, 12}, options(at::kLong));
    auto targets = at::randint(8, {2, 12}, options(at::kLong));
    opt.zero_grad();
    ref_opt.zero_grad();
    CommDebugMode mode;
    auto logits = model->forward(tokens);
    // Two blocks: forward gathers the root and both blocks over dp; over tp, one all-reduce
    // per row-wise projection (attention output and MLP output of each block).
    REQUIRE(mode.count("dp", CollectiveKind::AllGather) == over(dp.size(), 3));
    REQUIRE(mode.count("tp", CollectiveKind::AllReduce) == over(mesh["tp"].size(), 4));
    auto full_logits = DTensor(logits).full_tensor(); // Replicate already: no collective
    REQUIRE(mode.count("tp", CollectiveKind::AllReduce) == over(mesh["tp"].size(), 4));
    auto loss = torch::nn::functional::cross_entropy(full_logits.view({-1, 8}), targets.view(-1));
    loss.backward();
    REQUIRE(mode.count("dp", CollectiveKind::ReduceScatter) == over(dp.size(), 3));
    auto ref_loss =
        torch::nn::functional::cross_entropy(ref->forward(tokens).view({-1, 8}), targets.view(-1));
    ref_loss.backward();
    REQUIRE(near(loss, ref_loss));
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("grad " << p[i].key());
      REQUIRE(near(full_value(p[i].value().grad()), q[i].value().grad()));
    }
    opt.step();
    ref_opt.step();
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("param " << p[i].key());
      REQUIRE(near(full_value(p[i].value()), q[i].value()));
    }
  }
}

TEST_CASE("FSDP x TP: parameters distributed by hand on the tp mesh",
          "[fsdp_tp][world1][world2][world4]") {
  // DTensor parameters made with distribute_tensor (not parallelize_module)
  // are sharded over dp beside their tp placement. PyTorch shows (Shard(0), Replicate()) and
  // (_StridedShard(0, sf=2), Shard(0)) on (dp, tp); dtensor orders the mesh (tp, dp) so
  // that nested Shard gives the same pieces ([Note: FSDP x TP]).
  auto mesh = mesh_2d();
  auto dp = mesh["dp"];
  auto tp = mesh["tp"];
  for (const Placement& p : {Placement::replicate(), Placement::shard(0)}) {
    INFO("tp placement " << p.to_string());
    torch::manual_seed(3);
    torch::nn::Linear ref(8, 6);
    ref->to(options().device());
    torch::nn::Linear lin(8, 6);
    {
      torch::NoGradGuard no_grad;
      lin->weight.set_data(dtensor::distribute_tensor(ref->weight.detach().clone(), tp, {p}));
      lin->bias.set_data(dtensor::distribute_tensor(ref->bias.detach().clone(), tp, {p}));
    }
    dtensor::fully_shard(*lin, FullyShardOptions().mesh(dp));
    const DTensor w(lin->weight);
    REQUIRE(w.device_mesh().dim_names() == std::vector<std::string>{"tp", "dp"});
    REQUIRE(w.placements() == Placements{p, Placement::shard(0)});
    REQUIRE(close(full_value(lin->weight), ref->weight.detach(), 0, 0));
    REQUIRE(close(full_value(lin->bias), ref->bias.detach(), 0, 0));
    torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      INFO("step " << step);
      torch::manual_seed(40 + step);
      at::Tensor x = at::randn({4, 8}, options());
      at::Tensor out = lin->forward(DTensor::from_local(x, tp, {Placement::replicate()}));
      at::Tensor ref_out = ref->forward(x);
      REQUIRE(close(full_value(out), ref_out.detach(), 1e-5, 1e-6));
      out.pow(2).sum().backward();
      ref_out.pow(2).sum().backward();
      REQUIRE(close(full_value(lin->weight.grad()), ref->weight.grad(), 1e-4, 1e-5));
      REQUIRE(close(full_value(lin->bias.grad()), ref->bias.grad(), 1e-4, 1e-5));
      opt.step();
      ref_opt.step();
      opt.zero_grad();
      ref_opt.zero_grad();
      REQUIRE(close(full_value(lin->weight), ref->weight.detach(), 1e-5, 1e-6));
    }
  }
  SECTION("a DTensor on the data-parallel mesh itself, or Partial, is refused") {
    torch::nn::Linear a(8, 6);
    a->weight.set_data(dtensor::distribute_tensor(a->weight.detach(), dp, {Placement::shard(0)}));
    REQUIRE_THROWS_WITH(dtensor::fully_shard(*a, FullyShardOptions().mesh(dp)),
                        contains("not another dimension of the data-parallel mesh"));
    torch::nn::Linear b(8, 6);
    b->weight.set_data(DTensor::from_local(b->weight.detach(), tp, {Placement::partial()}));
    REQUIRE_THROWS_WITH(dtensor::fully_shard(*b, FullyShardOptions().mesh(dp)),
                        contains("a parameter can be Shard or Replicate"));
  }
}
