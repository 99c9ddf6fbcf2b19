// A torch::nn::Linear whose parameters are converted
// in place into DTensors (set_data: same handles for the module, parameters() and an
// optimizer built before) trains with AdamW exactly like the plain module.
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"

namespace {

void convert(torch::nn::Linear& lin, const dtensor::DeviceMesh& mesh, const Placements& weight,
             const Placements& bias) {
  torch::NoGradGuard no_grad;
  lin->weight.set_data(dtensor::distribute_tensor(lin->weight.detach(), mesh, weight));
  lin->bias.set_data(dtensor::distribute_tensor(lin->bias.detach(), mesh, bias));
}

} // namespace

TEST_CASE("Linear with DTensor parameters trains like the plain module",
          "[dtensor][module][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"tp"});
  struct Layout {
    const char* name;
    Placements weight, bias, input;
  };
  std::vector<Layout> layouts = {
      {"replicated", {Placement::replicate()}, {Placement::replicate()}, {Placement::replicate()}},
      {"colwise", {Placement::shard(0)}, {Placement::shard(0)}, {Placement::replicate()}},
      {"rowwise", {Placement::shard(1)}, {Placement::replicate()}, {Placement::shard(-1)}},
  };
  for (bool optimizer_first : {true, false}) {
    for (const auto& layout : layouts) {
      INFO(layout.name << (optimizer_first ? ", optimizer built before the conversion" : ""));
      torch::manual_seed(7);
      torch::nn::Linear ref(torch::nn::LinearOptions(8, 6));
      torch::nn::Linear lin(torch::nn::LinearOptions(8, 6));
      {
        torch::NoGradGuard no_grad;
        lin->weight.copy_(ref->weight);
        lin->bias.copy_(ref->bias);
      }
      ref->to(options().device());
      lin->to(options().device());
      at::TensorImpl* weight_impl = lin->weight.unsafeGetTensorImpl();
      std::unique_ptr<torch::optim::AdamW> opt;
      if (optimizer_first) {
        opt = std::make_unique<torch::optim::AdamW>(lin->parameters(), torch::optim::AdamWOptions(0.05));
      }
      convert(lin, mesh, layout.weight, layout.bias);
      if (!optimizer_first) {
        opt = std::make_unique<torch::optim::AdamW>(lin->parameters(), torch::optim::AdamWOptions(0.05));
      }
      // Identity kept: the module's member, parameters() and the optimizer hold one tensor.
      REQUIRE(lin->weight.unsafeGetTensorImpl() == weight_impl);
      REQUIRE(dtensor::is_dtensor(lin->parameters()[0]));
      REQUIRE(DTensor(lin->weight).placements() == layout.weight);
      torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.05));

      for (int step = 0; step < 3; ++step) {
        at::Tensor x = at::randn({4, 8}, options());
        opt->zero_grad();
        ref_opt.zero_grad();
        at::Tensor y = lin->forward(dtensor::distribute_tensor(x, mesh, layout.input));
        at::Tensor loss = (y * y).sum();
        loss.backward();
        at::Tensor ref_loss = (ref->forward(x) * ref->forward(x)).sum();
        ref_loss.backward();
        REQUIRE(dtensor::is_dtensor(loss));
        REQUIRE(close(DTensor(loss).full_tensor(), ref_loss.detach()));
        REQUIRE(dtensor::is_dtensor(lin->weight.grad()));
        REQUIRE(close(DTensor(lin->weight.grad()).full_tensor(), ref->weight.grad()));
        REQUIRE(close(DTensor(lin->bias.grad()).full_tensor(), ref->bias.grad()));
        opt->step();
        ref_opt.step();
        REQUIRE(DTensor(lin->weight).placements() == layout.weight);
        REQUIRE(close(DTensor(lin->weight).full_tensor(), ref->weight.detach()));
        REQUIRE(close(DTensor(lin->bias).full_tensor(), ref->bias.detach()));
      }
    }
  }
}

TEST_CASE("SGD with momentum steps on DTensor parameters", "[dtensor][module][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  torch::manual_seed(3);
  torch::nn::Linear ref(5, 3);
  torch::nn::Linear lin(5, 3);
  {
    torch::NoGradGuard no_grad;
    lin->weight.copy_(ref->weight);
    lin->bias.copy_(ref->bias);
  }
  convert(lin, mesh, {Placement::shard(0)}, {Placement::shard(0)});
  auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::optim::SGD opt(lin->parameters(), sgd);
  torch::optim::SGD ref_opt(ref->parameters(), sgd);
  for (int step = 0; step < 3; ++step) {
    at::Tensor x = at::randn({2, 5});
    opt.zero_grad();
    ref_opt.zero_grad();
    lin->forward(dtensor::distribute_tensor(x, mesh, {Placement::replicate()})).sum().backward();
    ref->forward(x).sum().backward();
    opt.step();
    ref_opt.step();
    REQUIRE(close(DTensor(lin->weight).full_tensor(), ref->weight.detach()));
  }
}

TEST_CASE("ops without a rule, plain tensors and other meshes give clear errors",
          "[dtensor][errors][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  auto other = init_device_mesh(device_type(), {world()}, {"tp"});
  DTensor a = dtensor::distribute_tensor(at::ones({4, 4}, options()), mesh, {Placement::shard(0)});
  DTensor b = dtensor::distribute_tensor(at::ones({4, 4}, options()), other, {Placement::shard(0)});
  REQUIRE_THROWS_WITH(a + b, contains("aten::add.Tensor: DTensor arguments live on different meshes"));
  REQUIRE_THROWS_WITH(a + at::ones({4, 4}, options()),
                      contains("aten::add.Tensor: mixes DTensors with plain tensors (argument 1 'other'"));
  // renorm has no rule and its own CPU kernel (no decomposition to fall back on).
  REQUIRE_THROWS_WITH(at::renorm(a, 2, 0, 1.0), contains("aten::renorm"));
  REQUIRE_THROWS_WITH(at::renorm(a, 2, 0, 1.0), contains("no sharding rule is registered for it"));
  REQUIRE_THROWS_WITH(at::renorm(a, 2, 0, 1.0), contains("(Shard(0))"));
  // Without a rule, an op still runs on DTensors that are Replicate everywhere.
  const at::Tensor full = at::arange(6, options()).view({2, 3});
  DTensor rep = dtensor::distribute_tensor(full, mesh, {Placement::replicate()});
  at::Tensor rn = at::renorm(rep, 2, 0, 1.0);
  REQUIRE(DTensor(rn).placements() == Placements{Placement::replicate()});
  REQUIRE(dtensor::testing::same(DTensor(rn).full_tensor(), at::renorm(full, 2, 0, 1.0)));
  // An op without a rule but with a composite kernel runs it: view_copy = view + clone,
  // each with its rule (the shard stays, no collective).
  DTensor wide = dtensor::distribute_tensor(at::arange(32, options()).view({8, 4}), mesh,
                                            {Placement::shard(0)});
  dtensor::CommDebugMode counts;
  at::Tensor vc = at::view_copy(wide, {8, 2, 2});
  REQUIRE(counts.total_count() == 0);
  REQUIRE(DTensor(vc).placements() == Placements{Placement::shard(0)});
  REQUIRE(dtensor::testing::same(DTensor(vc).full_tensor(), at::arange(32, options()).view({8, 2, 2})));
  // Scalars and 0-dim tensors mix implicitly.
  at::Tensor c = a * 2 + at::scalar_tensor(1.0, options());
  REQUIRE(dtensor::testing::same(DTensor(c).full_tensor(), at::full({4, 4}, 3.0, options())));
}
