// Optimizer state dicts keyed by parameter name (get/set_optimizer_state_dict): the state
// of DTensor parameters has their placements; the full state equals the plain model's
// optimizer state; loading it into another layout (or a plain model) continues training
// exactly like the plain model; bad dicts are refused before anything is written.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <dtensor/optim_state_dict.h>

#include "support/prelude.h"
#include <models/mlp_models.h>

using dtensor::testing::near;

namespace {

torch::nn::Sequential stack_model() {
  torch::manual_seed(0);
  auto m = dtensor::models::mlp_stack(8);
  m->to(options().device());
  return m;
}

void train(torch::nn::Module& m, torch::optim::Optimizer& opt, int steps, uint64_t seed) {
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(seed + static_cast<uint64_t>(s)); // the same batch on every rank
    at::Tensor x = at::randn({4, 8}, options());
    opt.zero_grad();
    auto seq = m.as<torch::nn::Sequential>();
    at::Tensor out = seq != nullptr ? seq->forward(x) : m.as<dtensor::models::MLP>()->forward(x);
    out.sum().backward();
    opt.step();
  }
}

void require_same_params(torch::nn::Module& a, torch::nn::Module& b) {
  auto q = b.named_parameters();
  for (const auto& item : a.named_parameters()) {
    INFO("parameter " << item.key());
    REQUIRE(near(full_value(item.value()), full_value(q[item.key()])));
  }
}

} // namespace

TEST_CASE("optimizer state dict: plain module, Adam, round trip continues identically",
          "[optim_state_dict][world1][world2][world4]") {
  auto a = stack_model();
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(1e-2));
  train(*a, opt_a, 2, 10);
  const dtensor::StateDict sd = dtensor::get_optimizer_state_dict(*a, opt_a);
  REQUIRE(sd.contains("state.0.in_proj.weight.exp_avg"));
  REQUIRE(sd.contains("state.0.in_proj.weight.step"));
  REQUIRE(sd["state.0.in_proj.weight.step"].item<double>() == 2);
  REQUIRE(sd["param_groups.0.in_proj.weight.lr"].item<double>() == 1e-2);
  auto b = stack_model();
  {
    torch::NoGradGuard no_grad;
    auto pa = a->named_parameters();
    for (auto& item : b->named_parameters()) {
      item.value().copy_(pa[item.key()]);
    }
  }
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions(0.5)); // overwritten
  dtensor::set_optimizer_state_dict(*b, opt_b, sd);
  REQUIRE(static_cast<torch::optim::AdamOptions&>(opt_b.param_groups()[0].options()).lr() == 1e-2);
  train(*a, opt_a, 2, 20);
  train(*b, opt_b, 2, 20);
  auto pb = b->named_parameters();
  for (const auto& item : a->named_parameters()) {
    INFO(item.key());
    REQUIRE(same(item.value().detach(), pb[item.key()].detach()));
  }
}

TEST_CASE("optimizer state dict: fully_shard AdamW, sharded, full, and resharded on load",
          "[optim_state_dict][world1][world2][world4]") {
  auto ref = stack_model();
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  train(*ref, ref_opt, 2, 30);
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  auto m = stack_model();
  for (const auto& child : m->children()) {
    dtensor::fully_shard(*child, FullyShardOptions().mesh(mesh));
  }
  dtensor::fully_shard(*m, FullyShardOptions().mesh(mesh));
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-2));
  train(*m, opt, 2, 30);

  auto params = m->named_parameters();
  const dtensor::StateDict sharded = dtensor::get_optimizer_state_dict(*m, opt);
  for (const auto& item : params) {
    INFO(item.key());
    const at::Tensor& v = sharded["state." + item.key() + ".exp_avg_sq"];
    REQUIRE(dtensor::is_dtensor(v));
    REQUIRE(DTensor(v).placements() == DTensor(item.value()).placements());
  }
  dtensor::StateDict full;
  {
    CommDebugMode mode;
    full = dtensor::get_optimizer_state_dict(*m, opt, dtensor::StateDictOptions().full_state_dict(true));
    REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 2 * static_cast<int64_t>(params.size())));
  }
  const dtensor::StateDict want = dtensor::get_optimizer_state_dict(*ref, ref_opt);
  REQUIRE(full.size() == want.size());
  for (const auto& item : want) {
    INFO(item.key());
    REQUIRE_FALSE(dtensor::is_dtensor(full[item.key()]));
    REQUIRE(near(full[item.key()], item.value()));
  }

  // Resharded on load: HSDP on 4 ranks, 1-D FSDP otherwise, and a plain module.
  auto other = stack_model();
  auto other_mesh = world() == 4 ? init_device_mesh(device_type(), {2, 2}, {"rep", "shard"}) : mesh;
  for (const auto& child : other->children()) {
    dtensor::fully_shard(*child, FullyShardOptions().mesh(other_mesh));
  }
  dtensor::fully_shard(*other, FullyShardOptions().mesh(other_mesh));
  torch::optim::AdamW other_opt(other->parameters(), torch::optim::AdamWOptions(1e-3));
  dtensor::set_model_state_dict(*other, dtensor::get_model_state_dict(*ref),
                                dtensor::StateDictOptions().full_state_dict(true));
  dtensor::set_optimizer_state_dict(*other, other_opt, sharded); // DTensors, redistributed
  auto plain = stack_model();
  torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-3));
  dtensor::set_model_state_dict(*plain, dtensor::get_model_state_dict(*ref));
  dtensor::set_optimizer_state_dict(*plain, plain_opt, full);
  train(*ref, ref_opt, 2, 40);
  train(*m, opt, 2, 40);
  train(*other, other_opt, 2, 40);
  train(*plain, plain_opt, 2, 40);
  require_same_params(*m, *ref);
  require_same_params(*other, *ref);
  require_same_params(*plain, *ref);
}

TEST_CASE("optimizer state dict: tensor parallelism with SGD momentum",
          "[optim_state_dict][world1][world2][world4]") {
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  auto make = [] {
    torch::manual_seed(5);
    dtensor::models::MLP m(8);
    m->to(options().device());
    return m;
  };
  auto ref = make();
  auto mlp = make();
  dtensor::parallelize_module(*mlp, tp,
                              {{"in_proj", std::make_shared<dtensor::ColwiseParallel>()},
                               {"out_proj", std::make_shared<dtensor::RowwiseParallel>()}});
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::optim::SGD ref_opt(ref->parameters(), sgd);
  torch::optim::SGD opt(mlp->parameters(), sgd);
  train(*ref, ref_opt, 2, 50);
  train(*mlp, opt, 2, 50);
  const dtensor::StateDict sd = dtensor::get_optimizer_state_dict(*mlp, opt);
  REQUIRE(DTensor(sd["state.in_proj.weight.momentum_buffer"]).placements() ==
          Placements{Placement::shard(0)});
  REQUIRE(DTensor(sd["state.out_proj.weight.momentum_buffer"]).placements() ==
          Placements{Placement::shard(1)});
  REQUIRE(sd["param_groups.out_proj.bias.momentum"].item<double>() == 0.9);
  const dtensor::StateDict full =
      dtensor::get_optimizer_state_dict(*mlp, opt, dtensor::StateDictOptions().full_state_dict(true));
  for (const auto& item : dtensor::get_optimizer_state_dict(*ref, ref_opt)) {
    INFO(item.key());
    REQUIRE(near(full[item.key()], item.value()));
  }
  // Into a plain copy of the model: training goes on like the reference.
  auto plain = make();
  dtensor::set_model_state_dict(*plain, dtensor::get_model_state_dict(*ref));
  torch::optim::SGD plain_opt(plain->parameters(), torch::optim::SGDOptions(1.0));
  dtensor::set_optimizer_state_dict(*plain, plain_opt, sd);
  train(*ref, ref_opt, 2, 60);
  train(*plain, plain_opt, 2, 60);
  require_same_params(*plain, *ref);
}

TEST_CASE("optimizer state dict: bad dicts are refused before anything is written",
          "[optim_state_dict][errors][world1][world2][world4]") {
  auto m = stack_model();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  train(*m, opt, 1, 70);
  const dtensor::StateDict good = dtensor::get_optimizer_state_dict(*m, opt);
  auto with = [&](const std::string& key, const at::Tensor& v) {
    dtensor::StateDict d = good;
    d.insert(key, v);
    return d;
  };
  REQUIRE_THROWS_WITH(dtensor::set_optimizer_state_dict(*m, opt, with("state.nope.weight.exp_avg", at::zeros({2}))),
                      contains("key 'state.nope.weight.exp_avg' names 'nope.weight', which is not a parameter"));
  dtensor::StateDict bad_shape = good;
  bad_shape["state.0.in_proj.weight.exp_avg"] = at::zeros({3, 3}, options());
  REQUIRE_THROWS_WITH(dtensor::set_optimizer_state_dict(*m, opt, bad_shape),
                      contains("'state.0.in_proj.weight.exp_avg' has shape [3, 3] but parameter '0.in_proj.weight' is [24, 8]"));
  REQUIRE_THROWS_WITH(dtensor::set_optimizer_state_dict(*m, opt, with("state.0.in_proj.weight.momentum_buffer", at::zeros({24, 8}))),
                      contains("Adam has no state field 'momentum_buffer'"));
  REQUIRE_THROWS_WITH(dtensor::set_optimizer_state_dict(*m, opt, with("bogus", at::zeros({1}))),
                      contains("key 'bogus' is neither"));
  // Nothing was written by the refused calls.
  const dtensor::StateDict after = dtensor::get_optimizer_state_dict(*m, opt);
  for (const auto& item : good) {
    INFO(item.key());
    REQUIRE(same(after[item.key()], item.value()));
  }
}
