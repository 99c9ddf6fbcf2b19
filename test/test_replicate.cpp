// replicate(): DDP semantics (initial broadcast, averaged gradients by bucketed all-reduce,
// gradient accumulation without sync) against a single-process reference over every rank's
// batch.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"

namespace {

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
}

at::Tensor batch(int r, int step) {
  at::manual_seed(1000 + 17 * step + r); // rank r's data, reproducible on every rank
  return at::randn({3, 8}, options());
}

// The reference: one process sees every rank's batch and averages the gradients.
void reference_backward(torch::nn::Sequential& ref, int step) {
  for (int r = 0; r < world(); ++r) {
    (ref->forward(batch(r, step)).pow(2).sum() / world()).backward();
  }
}

} // namespace

TEST_CASE("replicate: broadcast, averaged gradients, bucket counts, parity with SGD",
          "[replicate][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  for (double cap_mb : {25.0, 1e-9}) {
    INFO("bucket_cap_mb " << cap_mb);
    torch::manual_seed(0);
    auto ref = mlp();
    torch::manual_seed(100 + rank()); // every rank starts from different weights
    auto model = mlp();
    ref->to(options().device());
    model->to(options().device());
    auto handle = dtensor::replicate(*model, mesh, dtensor::ReplicateOptions().bucket_cap_mb(cap_mb));
    // rank 0's weights everywhere; copy them into the reference too
    {
      torch::NoGradGuard no_grad;
      auto src = model->parameters();
      auto dst = ref->parameters();
      for (size_t i = 0; i < src.size(); ++i) {
        auto from0 = dtensor::all_gather_tensor(src[i].detach().unsqueeze(0), 0, mesh.get_group());
        for (int r = 0; r < world(); ++r) {
          REQUIRE(at::equal(from0[r].cpu(), from0[0].cpu()));
        }
        dst[i].copy_(src[i]);
      }
    }
    REQUIRE(handle.num_buckets() == (cap_mb > 1 ? 1 : 4));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      CommDebugMode mode;
      model->forward(batch(rank(), step)).pow(2).sum().backward();
      REQUIRE(mode.count(CollectiveKind::AllReduce) == handle.num_buckets());
      REQUIRE(mode.total_count() == handle.num_buckets());
      reference_backward(ref, step);
      auto p = model->parameters();
      auto q = ref->parameters();
      for (size_t i = 0; i < p.size(); ++i) {
        REQUIRE(close(p[i].grad(), q[i].grad()));
      }
      opt.step();
      ref_opt.step();
      for (size_t i = 0; i < p.size(); ++i) {
        REQUIRE(close(p[i], q[i]));
      }
    }
  }
}

TEST_CASE("replicate: gradient accumulation without sync", "[replicate][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  torch::manual_seed(0);
  auto ref = mlp();
  ref->to(options().device());
  auto model = mlp();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i) {
      model->parameters()[i].copy_(ref->parameters()[i]);
    }
  }
  auto handle = dtensor::replicate(*model, mesh);
  handle.set_requires_gradient_sync(false);
  CommDebugMode mode;
  model->forward(batch(rank(), 0)).pow(2).sum().backward(); // local only
  REQUIRE(mode.total_count() == 0);
  handle.set_requires_gradient_sync(true);
  model->forward(batch(rank(), 1)).pow(2).sum().backward(); // accumulated, then averaged
  REQUIRE(mode.count(CollectiveKind::AllReduce) == 1);
  reference_backward(ref, 0);
  reference_backward(ref, 1);
  for (size_t i = 0; i < ref->parameters().size(); ++i) {
    REQUIRE(close(model->parameters()[i].grad(), ref->parameters()[i].grad()));
  }
}

TEST_CASE("replicate: unused parameters get averaged zero gradients", "[replicate][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  auto handle = dtensor::replicate(*model, mesh, dtensor::ReplicateOptions().bucket_cap_mb(1e-9));
  CommDebugMode mode;
  // Only the first layer is used: its bucket(s) reduce from the hooks, the second layer's
  // when the backward ends.
  model[0]->as<torch::nn::Linear>()->forward(at::ones({2, 4}, options())).sum().backward();
  REQUIRE(mode.count(CollectiveKind::AllReduce) == 4);
  auto unused = model[1]->as<torch::nn::Linear>()->weight.grad();
  REQUIRE(unused.defined());
  REQUIRE(unused.abs().sum().item<float>() == 0.0f);
}

TEST_CASE("replicate: errors", "[replicate][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  auto model = mlp();
  auto handle = dtensor::replicate(*model, mesh);
  REQUIRE_THROWS_WITH(dtensor::replicate(*model, mesh), contains("already replicated"));
  auto mesh2 = init_device_mesh(device_type(), {world(), 1}, {"a", "b"});
  auto other = mlp();
  REQUIRE_THROWS_WITH(dtensor::replicate(*other, mesh2), contains("needs a 1-D mesh, got DeviceMesh("));
}
