// fully_shard on PyTorch's common_fsdp.py toolkit and common_dtensor's Transformer:
// several SGD-momentum steps in parity with a data-parallel reference (same model, gradients
// averaged over the ranks), with the collective counts of every forward and backward.
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"
#include <models/fsdp_models.h>

namespace {

struct Counts {
  int64_t forward_all_gathers;
  int64_t backward_all_gathers;
  int64_t reduce_scatters;
};

// DDP's gradients for the reference: the average over the ranks, of every parameter that
// `keep_local` does not exclude.
void average_grads(torch::nn::Module& ref,
                   const std::function<bool(const at::Tensor&)>& keep_local = nullptr) {
  for (auto& p : ref.parameters()) {
    if (p.grad().defined() && !(keep_local && keep_local(p))) {
      dtensor::all_reduce_(p.mutable_grad(), dtensor::ReduceOp::Avg, dtensor::world_group());
    }
  }
}

// `loss_fn(module, step)` runs one forward and returns the loss; it must draw the same
// random numbers for both models (reseed inside it).
template <typename M>
void train_in_parity(M& model, M& ref, const std::function<at::Tensor(M&, int)>& loss_fn,
                     Counts counts,
                     const std::function<bool(const at::Tensor&)>& keep_local = nullptr,
                     int steps = 3) {
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.02).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.02).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    INFO("step " << step);
    opt.zero_grad();
    ref_opt.zero_grad();
    at::Tensor loss;
    {
      CommDebugMode fwd;
      loss = loss_fn(model, step);
      REQUIRE(fwd.count(CollectiveKind::AllGather) == over(world(), counts.forward_all_gathers));
      REQUIRE(fwd.total_count() == over(world(), counts.forward_all_gathers));
    }
    {
      CommDebugMode bwd;
      loss.backward();
      REQUIRE(bwd.count(CollectiveKind::AllGather) == over(world(), counts.backward_all_gathers));
      REQUIRE(bwd.count(CollectiveKind::ReduceScatter) == over(world(), counts.reduce_scatters));
      REQUIRE(bwd.total_count() ==
              over(world(), counts.backward_all_gathers + counts.reduce_scatters));
    }
    auto ref_loss = loss_fn(ref, step);
    ref_loss.backward();
    average_grads(*ref, keep_local);
    REQUIRE(close(loss, ref_loss, 1e-4, 1e-5));
    opt.step();
    ref_opt.step();
    auto p = model->named_parameters();
    auto q = ref->named_parameters();
    REQUIRE(p.size() == q.size());
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("parameter " << p[i].key());
      REQUIRE(p[i].key() == q[i].key());
      REQUIRE(close(full_value(p[i].value()), q[i].value(), 1e-4, 1e-5));
    }
  }
}

} // namespace

TEST_CASE("fsdp models: common_dtensor Transformer, each block and the root",
          "[fsdp_models][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  using dtensor::models::Transformer;
  torch::manual_seed(0);
  Transformer ref;
  torch::manual_seed(0);
  Transformer model;
  ref->to(options().device());
  model->to(options().device());
  for (auto& layer : *model->layers) {
    dtensor::fully_shard(*layer, FullyShardOptions().mesh(dp));
  }
  dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  auto loss_fn = [](Transformer& m, int step) {
    at::manual_seed(300 + 7 * step + rank()); // tokens and dropout masks
    auto tokens = at::randint(8, {2, 12}, options(at::kLong));
    auto targets = at::randint(8, {2, 12}, options(at::kLong));
    auto logits = m->forward(tokens);
    return torch::nn::functional::cross_entropy(logits.view({-1, 8}), targets.view(-1));
  };
  // Root + 2 blocks: forward 3 all-gathers, backward 2, reduce-scatters 3 (PyTorch's counts).
  train_in_parity<Transformer>(model, ref, loss_fn, {3, 2, 3});
}

TEST_CASE("fsdp models: TransformerWithSharedParams, encoder and decoder layers and the root",
          "[fsdp_models][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  using dtensor::models::TransformerWithSharedParams;
  TransformerWithSharedParams ref(rank(), /*add_bn=*/true, /*deterministic=*/true);
  TransformerWithSharedParams model(rank(), true, true);
  ref->to(options().device());
  model->to(options().device());
  int64_t layers = 0;
  for (const auto& item : model->named_modules()) {
    const std::string kind = item.value()->name();
    if (kind.find("TransformerEncoderLayer") != std::string::npos ||
        kind.find("TransformerDecoderLayer") != std::string::npos) {
      dtensor::fully_shard(*item.value(), FullyShardOptions().mesh(dp));
      ++layers;
    }
  }
  REQUIRE(layers == 4);
  dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  auto loss_fn = [](TransformerWithSharedParams& m, int step) {
    auto input = m->get_input(options().device()); // reseeds: same dropout masks in both
    return m->get_loss(input, m->forward(input[0], input[1]));
  };
  // The shared embedding / output weight lives in the root unit.
  train_in_parity<TransformerWithSharedParams>(model, ref, loss_fn, {5, 4, 5});
}

TEST_CASE("fsdp models: NestedWrappedModule with nested units",
          "[fsdp_models][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  using dtensor::models::NestedWrappedModule;
  NestedWrappedModule ref(rank(), /*deterministic=*/true);
  NestedWrappedModule model(rank(), true);
  ref->to(options().device());
  model->to(options().device());
  // module.1.0 inside module.1, then module.2, then the root (module.0 and module.3).
  auto opts = FullyShardOptions().mesh(dp);
  dtensor::fully_shard(*model->module->ptr(1)->as<torch::nn::SequentialImpl>()->ptr(0), opts);
  dtensor::fully_shard(*model->module->ptr(1), opts);
  dtensor::fully_shard(*model->module->ptr(2), opts);
  dtensor::fully_shard(*model, opts);
  auto loss_fn = [](NestedWrappedModule& m, int step) {
    auto input = m->get_input(options().device());
    return m->get_loss(input, m->forward(input[0]));
  };
  train_in_parity<NestedWrappedModule>(model, ref, loss_fn, {4, 3, 4});
}

TEST_CASE("fsdp models: NonUniformReqGradNWM (frozen parameters)",
          "[fsdp_models][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto ref = dtensor::models::nonuniform_req_grad_nwm(rank(), /*deterministic=*/true);
  auto model = dtensor::models::nonuniform_req_grad_nwm(rank(), true);
  ref->to(options().device());
  model->to(options().device());
  auto opts = FullyShardOptions().mesh(dp);
  dtensor::fully_shard(*model->module->ptr(1), opts);
  dtensor::fully_shard(*model->module->ptr(2), opts);
  dtensor::fully_shard(*model, opts);
  auto loss_fn = [](dtensor::models::NonUniformReqGradNWM& m, int step) {
    auto input = m->get_input(options().device());
    return m->get_loss(input, m->forward(input[0]));
  };
  // Only module.2.1 trains: one reduce-scatter. Backward needs no parameter of a resharded
  // unit (module.1's gradients are not wanted), so no all-gather either; PyTorch's module
  // hooks would gather module.2 again.
  train_in_parity<dtensor::models::NonUniformReqGradNWM>(model, ref, loss_fn, {3, 0, 1});
}

TEST_CASE("fsdp models: MixtureOfExperts, experts on a group of one",
          "[fsdp_models][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world(), 1}, {"dp", "expert"});
  using dtensor::models::MixtureOfExperts;
  MixtureOfExperts ref(rank(), /*deterministic=*/true);
  MixtureOfExperts model(rank(), true);
  ref->to(options().device());
  model->to(options().device());
  dtensor::fully_shard(*model->expert, FullyShardOptions().mesh(mesh["expert"]));
  dtensor::fully_shard(*model->shared, FullyShardOptions().mesh(mesh["dp"]));
  dtensor::fully_shard(*model, FullyShardOptions().mesh(mesh["dp"]));
  auto loss_fn = [](MixtureOfExperts& m, int step) {
    auto input = m->get_input(options().device());
    return m->get_loss(input, m->forward(input[0]));
  };
  // Expert gradients stay local (every rank has its own expert); the others are averaged.
  // The root and the shared unit's counts: the expert's unit, on a group of one, aliases
  // and issues none (PyTorch's FSDP2 none either).
  auto is_expert = [&](const at::Tensor& p) { return ref->is_expert_param(p); };
  train_in_parity<MixtureOfExperts>(model, ref, loss_fn, {2, 1, 2}, is_expert);
}
