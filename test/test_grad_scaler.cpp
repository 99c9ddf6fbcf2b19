// GradScaler (PyTorch's test_fsdp_sharded_grad_scaler.py, per-parameter): nested scaling,
// sparse unscaling, skipped steps, scale growth / backoff against torch.amp.GradScaler's
// rules, and found-inf agreed across ranks with one all-reduce per sharded mesh dimension,
// over gradients on several meshes.
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "support/prelude.h"
#include <models/mlp_models.h>

using dtensor::GradScaler;
using dtensor::GradScalerOptions;

namespace {

double value(const c10::IValue& v) {
  return v.toTensor().item<double>();
}

// The flag and the local gradients after one unscale_: every rank's flag must be the same.
float agreed_flag(const GradScaler& scaler, const torch::optim::Optimizer& opt) {
  at::Tensor f = scaler.found_inf(opt);
  REQUIRE(f.defined());
  at::Tensor all = dtensor::all_gather_tensor(f.to(options()), 0, dtensor::world_group()).cpu();
  REQUIRE(at::equal(all, at::full_like(all, all[0].item<float>())));
  return all[0].item<float>();
}

// Writes inf into element 0 of `rank`'s local piece of the gradient of `p` (if it has one).
void poison(const at::Tensor& p, int on_rank) {
  if (rank() != on_rank) {
    return;
  }
  at::Tensor g = p.grad();
  at::Tensor local = dtensor::is_dtensor(g) ? DTensor(g).to_local() : g;
  REQUIRE(local.numel() > 0);
  c10::NoGradGuard no_grad;
  local.view(-1)[0].fill_(INFINITY);
}

// The full value of a model output, differentiable (full_value is for comparisons only).
at::Tensor full_output(const at::Tensor& out) {
  return dtensor::is_dtensor(out) ? DTensor(out).full_tensor() : out;
}

} // namespace

TEST_CASE("GradScaler: nested outputs are scaled on their device (PyTorch's "
          "test_fsdp_sharded_grad_scaler.py)",
          "[grad_scaler][world1][world2][world4]") {
  GradScaler scaler(GradScalerOptions().init_scale(2.0));
  at::Tensor t0 = at::full({1}, 4.0, options());
  at::Tensor t1 = at::full({1}, 8.0, options());
  c10::impl::GenericList inner(c10::AnyType::get());
  inner.push_back(t0.clone());
  inner.push_back(t1.clone());
  c10::impl::GenericList outputs(c10::AnyType::get());
  outputs.push_back(t1.clone());
  outputs.push_back(c10::ivalue::Tuple::create({t0.clone(), t1.clone()}));
  outputs.push_back(inner);
  c10::IValue scaled = scaler.scale(c10::IValue(outputs));
  const auto& list = scaled.toListRef();
  REQUIRE(value(list[0]) == 16.0);
  REQUIRE(value(list[1].toTupleRef().elements()[0]) == 8.0);
  REQUIRE(value(list[1].toTupleRef().elements()[1]) == 16.0);
  REQUIRE(value(list[2].toListRef()[0]) == 8.0);
  REQUIRE(value(list[2].toListRef()[1]) == 16.0);
  REQUIRE(list[0].toTensor().device() == t1.device());
  REQUIRE(scaler.get_scale() == 2.0);
  auto v = scaler.scale(std::vector<at::Tensor>{t0, t1});
  REQUIRE((v[0].item<double>() == 8.0 && v[1].item<double>() == 16.0));
  REQUIRE_THROWS_WITH(scaler.scale(c10::IValue(3.0)), contains("must be tensors"));
  GradScaler off(GradScalerOptions().enabled(false));
  REQUIRE(same(off.scale(t1), t1));
  REQUIRE(off.get_scale() == 1.0);
}

TEST_CASE("GradScaler: sparse gradients unscale and report inf (PyTorch's "
          "test_fsdp_sharded_grad_scaler.py)",
          "[grad_scaler][world1][world2][world4]") {
  GradScaler scaler(GradScalerOptions().init_scale(2.0));
  scaler.scale(at::ones({1}));
  at::Tensor i = at::tensor({0, 1, 1, 2, 0, 2}, at::kLong).view({2, 3});
  at::Tensor v = at::tensor({16.0, 32.0, 64.0}, at::kFloat);
  at::Tensor s = at::sparse_coo_tensor(i, v, {2, 3});
  at::Tensor param = s.clone();
  param.mutable_grad() = s.clone();
  torch::optim::SGD opt(std::vector<at::Tensor>{param}, torch::optim::SGDOptions(1.0));
  scaler.unscale_(opt);
  REQUIRE(scaler.found_inf(opt).item<float>() == 0.0F);
  REQUIRE(same(param.grad().to_dense(), (s / 2).to_dense()));
  scaler.update(2.0);

  param.mutable_grad() =
      at::sparse_coo_tensor(i, at::tensor({16.0, 32.0, INFINITY}, at::kFloat), {2, 3});
  scaler.unscale_(opt);
  REQUIRE(scaler.found_inf(opt).item<float>() == 1.0F);
  scaler.update(2.0);

  // fp16 with duplicate indices: each value is finite, their sum (2^16) overflows fp16.
  at::Tensor i2 = at::tensor({1, 1, 1, 0, 0, 2}, at::kLong).view({2, 3});
  at::Tensor v2 = at::tensor({32768.0, 32768.0, 1.0}, at::kFloat).to(at::kHalf);
  at::Tensor s2 = at::sparse_coo_tensor(i2, v2, {2, 3});
  at::Tensor p2 = s2.clone();
  p2.mutable_grad() = s2.clone();
  torch::optim::SGD opt2(std::vector<at::Tensor>{p2}, torch::optim::SGDOptions(1.0));
  scaler.unscale_(opt2);
  REQUIRE(scaler.found_inf(opt2).item<float>() == 1.0F);
  REQUIRE_THROWS_WITH(scaler.unscale_(opt2), contains("already called"));
}

TEST_CASE("GradScaler: an inf gradient skips the step and backs the scale off (PyTorch's "
          "test_fsdp_sharded_grad_scaler.py)",
          "[grad_scaler][world1][world2][world4]") {
  GradScaler scaler(GradScalerOptions().init_scale(2.0).growth_interval(1));
  at::Tensor t0 = at::tensor({INFINITY}, options());
  t0.mutable_grad() = t0.clone();
  torch::optim::SGD opt(std::vector<at::Tensor>{t0}, torch::optim::SGDOptions(1.0));
  scaler.scale(at::full({1}, 4.0, options()));
  REQUIRE_FALSE(scaler.step(opt));
  REQUIRE_THROWS_WITH(scaler.step(opt), contains("already called"));
  scaler.update();
  REQUIRE(scaler.get_scale() == 1.0); // 2 * backoff 0.5

  // A clean step: the optimizer sees the unscaled gradient; after growth_interval (1)
  // clean steps the scale grows by growth_factor.
  at::Tensor w = at::full({2}, 1.0, options());
  w.mutable_grad() = at::full({2}, 3.0, options()); // as left by backward at scale 1
  torch::optim::SGD opt_w(std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.5));
  REQUIRE(scaler.step(opt_w));
  REQUIRE(same(w.detach(), at::full({2}, 1.0 - 0.5 * 3.0 / 1.0, options())));
  scaler.update();
  REQUIRE(scaler.get_scale() == 2.0);
  REQUIRE(scaler.get_growth_tracker() == 0);
  auto st = scaler.state_dict();
  GradScaler restored;
  restored.load_state_dict(st);
  REQUIRE(restored.get_scale() == 2.0);
  REQUIRE(restored.get_growth_interval() == 1);
}

TEST_CASE("GradScaler: found-inf on one rank's shard makes every rank skip (fully_shard)",
          "[grad_scaler][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  model->to(options().device());
  torch::manual_seed(0);
  torch::nn::Sequential ref(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  ref->to(options().device());
  for (auto& m : *model) {
    dtensor::fully_shard(*m.ptr(), FullyShardOptions().mesh(dp));
  }
  dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler(GradScalerOptions().init_scale(2.0));
  at::Tensor x = at::randn({3, 4}, options()); // the same batch on every rank
  for (bool inf : {false, true}) {
    INFO("inf " << inf);
    opt.zero_grad();
    ref->zero_grad();
    scaler.scale(full_output(model->forward(x)).sum()).backward();
    ref->forward(x).sum().backward();
    std::vector<at::Tensor> before;
    for (auto& p : model->parameters()) {
      before.push_back(full_value(p).clone());
    }
    if (inf) {
      poison(model->parameters()[0], world() - 1);
    }
    {
      CommDebugMode mode;
      scaler.unscale_(opt);
      REQUIRE(mode.total_count() == 1);
      REQUIRE(mode.count("dp", CollectiveKind::AllReduce) == 1);
    }
    REQUIRE(agreed_flag(scaler, opt) == (inf ? 1.0F : 0.0F));
    if (!inf) {
      // Unscaled gradients equal the plain model's (mean over identical ranks).
      auto params = model->parameters();
      auto ref_params = ref->parameters();
      for (size_t k = 0; k < params.size(); ++k) {
        REQUIRE(dtensor::testing::close(full_value(params[k].grad()), ref_params[k].grad()));
      }
    }
    REQUIRE(scaler.step(opt) == !inf);
    auto params = model->parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      REQUIRE(same(full_value(params[k]), before[k]) == inf);
    }
    double scale_before = scaler.get_scale();
    scaler.update();
    REQUIRE(scaler.get_scale() == (inf ? scale_before * 0.5 : scale_before));
  }
}

TEST_CASE("GradScaler: found-inf over gradients on two meshes, one all-reduce per dimension",
          "[grad_scaler][world4]") {
  // Mixed meshes: `a` fully sharded over dp (first in parameters()), `b` colwise
  // over tp then fully sharded over dp; an inf in rank 3's local shard of b.weight.grad.
  // PyTorch 2.9 reduces found-inf over the first gradient's mesh only (dp): ranks 0 and 2
  // step, 1 and 3 skip. Here every rank skips, with one all-reduce over dp and one over tp.
  auto mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
  auto dp = mesh["dp"];
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
  model->to(options().device());
  dtensor::parallelize_module(*model, mesh["tp"],
                              dtensor::ParallelizePlan{{"1", dtensor::ColwiseParallel()}});
  dtensor::fully_shard(*model[0], FullyShardOptions().mesh(dp));
  dtensor::fully_shard(*model[1], FullyShardOptions().mesh(dp));
  dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler(GradScalerOptions().init_scale(2.0));
  at::Tensor x = at::randn({3, 8}, options());
  scaler.scale(full_output(model->forward(x)).sum()).backward();
  std::vector<at::Tensor> before;
  for (auto& p : model->parameters()) {
    before.push_back(full_value(p).clone());
  }
  poison(model[1]->named_parameters()["weight"], 3);
  {
    CommDebugMode mode;
    scaler.unscale_(opt);
    REQUIRE(mode.total_count() == 2);
    REQUIRE(mode.count("dp", CollectiveKind::AllReduce) == 1);
    REQUIRE(mode.count("tp", CollectiveKind::AllReduce) == 1);
  }
  REQUIRE(agreed_flag(scaler, opt) == 1.0F);
  REQUIRE_FALSE(scaler.step(opt));
  auto params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    REQUIRE(same(full_value(params[k]), before[k]));
  }
  scaler.update();
  REQUIRE(scaler.get_scale() == 1.0);
}
