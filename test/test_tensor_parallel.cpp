// Tensor parallelism (parallelize_module with ColwiseParallel, RowwiseParallel,
// SequenceParallel) on unmodified torch::nn modules: outputs, gradients and SGD steps equal
// a plain single-process copy of the module; parameters and outputs have the documented
// placements; forward issues exactly the collectives the layouts call for.
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"
#include <models/mlp_models.h>

using dtensor::Replicate;
using dtensor::Shard;

namespace {

// The same values on every rank.
at::Tensor input(at::IntArrayRef shape, uint64_t seed) {
  torch::manual_seed(seed);
  return at::randn(shape, options());
}

torch::nn::Linear linear(int64_t in, int64_t out, uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Linear m(in, out);
  m->to(options().device());
  return m;
}

// LayerNorm(16) with seeded non-trivial affine parameters.
torch::nn::LayerNorm layer_norm(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::LayerNorm m(torch::nn::LayerNormOptions({16}));
  m->to(options().device());
  torch::NoGradGuard no_grad;
  m->weight.copy_(at::randn({16}, options()) * 0.5 + 1);
  m->bias.copy_(at::randn({16}, options()) * 0.1);
  return m;
}

// Every parameter of `tp_module` is a DTensor whose gradient's full tensor is the plain
// module's gradient.
void require_same_grads(torch::nn::Module& tp_module, torch::nn::Module& plain) {
  auto p = tp_module.named_parameters();
  auto q = plain.named_parameters();
  REQUIRE(p.size() == q.size());
  for (const auto& item : q) {
    INFO("gradient of " << item.key());
    const at::Tensor& g = p[item.key()].grad();
    REQUIRE(dtensor::is_dtensor(g));
    REQUIRE(close(full_value(g), item.value().grad(), 1e-4, 1e-5));
  }
}

void require_same_params(torch::nn::Module& tp_module, torch::nn::Module& plain) {
  auto p = tp_module.named_parameters();
  auto q = plain.named_parameters();
  REQUIRE(p.size() == q.size());
  for (const auto& item : q) {
    INFO("parameter " << item.key());
    REQUIRE(dtensor::is_dtensor(p[item.key()]));
    REQUIRE(close(full_value(p[item.key()]), item.value().detach(), 1e-4, 1e-5));
  }
}

} // namespace

TEST_CASE("ColwiseParallel: Linear shards its output features, no collective in forward",
          "[tensor_parallel][world1][world2][world4]") {
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  for (int64_t out_features : {12, 10}) { // 10: uneven over 4 ranks
    INFO("Linear(16, " << out_features << ")");
    auto ref = linear(16, out_features, 1);
    auto m = linear(16, out_features, 1);
    dtensor::parallelize_module(*m, tp, std::make_shared<dtensor::ColwiseParallel>());
    REQUIRE(dtensor::is_dtensor(m->weight));
    REQUIRE(DTensor(m->weight).placements() == Placements{Shard(0)});
    REQUIRE(DTensor(m->bias).placements() == Placements{Shard(0)});
    at::Tensor x = input({4, 16}, 10); // a plain input stands for a Replicate one
    at::Tensor out;
    {
      CommDebugMode mode;
      out = m->forward(x);
      REQUIRE(mode.total_count() == 0);
    }
    at::Tensor ref_out = ref->forward(x);
    // The output stays a DTensor (see [Note: local outputs]), sharded on its last dim.
    REQUIRE(dtensor::is_dtensor(out));
    REQUIRE(DTensor(out).placements()[0].normalized(out.dim()) == Shard(1));
    REQUIRE(close(full_value(out), ref_out.detach(), 1e-4, 1e-5));
    out.sum().backward(); // a DTensor scalar
    ref_out.sum().backward();
    require_same_grads(*m, *ref);
  }
}

TEST_CASE("RowwiseParallel: a Shard(-1) input, one all-reduce when the output is used",
          "[tensor_parallel][world1][world2][world4]") {
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  auto ref = linear(12, 16, 2);
  auto m = linear(12, 16, 2);
  dtensor::parallelize_module(*m, tp, std::make_shared<dtensor::RowwiseParallel>());
  REQUIRE(DTensor(m->weight).placements() == Placements{Shard(1)});
  REQUIRE(DTensor(m->bias).placements() == Placements{Replicate()});
  at::Tensor x = input({4, 12}, 20);
  at::Tensor xd = dtensor::distribute_tensor(x, tp, {Shard(-1)}); // its broadcast is not counted
  at::Tensor y;
  at::Tensor s;
  {
    CommDebugMode mode;
    y = m->forward(xd);
    s = y.sum(); // the first op outside the module reduces the Partial result
    REQUIRE(mode.count(CollectiveKind::AllReduce) == over(world(), 1));
    REQUIRE(mode.total_count() == over(world(), 1));
  }
  // y itself is the matmul's Partial result; the sum saw it as Replicate, and as
  // use_local_output (the default) asks, as its plain local tensor ([Note: local outputs]).
  REQUIRE(DTensor(y).placements()[0].is_partial());
  REQUIRE_FALSE(dtensor::is_dtensor(s));
  at::Tensor ref_y = ref->forward(x);
  at::Tensor ref_s = ref_y.sum();
  REQUIRE(close(DTensor(y).full_tensor().detach(), ref_y.detach(), 1e-4, 1e-5));
  REQUIRE(close(full_value(s), ref_s.detach(), 1e-4, 1e-5));
  s.backward();
  ref_s.backward();
  require_same_grads(*m, *ref);
}

TEST_CASE("RowwiseParallel: output_layouts Shard(1) gives one reduce-scatter",
          "[tensor_parallel][world1][world2][world4]") {
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  auto ref = linear(12, 16, 3);
  auto m = linear(12, 16, 3);
  auto style = std::make_shared<dtensor::RowwiseParallel>();
  style->output_layouts(Shard(1));
  dtensor::parallelize_module(*m, tp, style);
  at::Tensor x = input({2, 8, 12}, 30); // [batch, sequence, features]
  at::Tensor xd = dtensor::distribute_tensor(x, tp, {Shard(-1)});
  at::Tensor z;
  {
    CommDebugMode mode;
    z = torch::relu(m->forward(xd));
    REQUIRE(mode.count(CollectiveKind::ReduceScatter) == over(world(), 1));
    REQUIRE(mode.total_count() == over(world(), 1));
  }
  REQUIRE(DTensor(z).placements() == Placements{Shard(1)});
  at::Tensor ref_z = torch::relu(ref->forward(x));
  REQUIRE(close(full_value(z), ref_z.detach(), 1e-4, 1e-5));
  z.sum().backward();
  ref_z.sum().backward();
  require_same_grads(*m, *ref);
}

TEST_CASE("SequenceParallel: LayerNorm on sequence shards, no collective in forward",
          "[tensor_parallel][world1][world2][world4]") {
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  // A Shard(1) input is used as it is; a Replicate one is chunked locally.
  for (const Placement& layout : {Shard(1), Replicate()}) {
    INFO("input " << layout);
    auto ref = layer_norm(4);
    auto m = layer_norm(4);
    dtensor::parallelize_module(*m, tp, std::make_shared<dtensor::SequenceParallel>());
    REQUIRE(DTensor(m->weight).placements() == Placements{Replicate()});
    REQUIRE(DTensor(m->bias).placements() == Placements{Replicate()});
    at::Tensor x = input({2, 8, 16}, 40);
    at::Tensor xd = dtensor::distribute_tensor(x, tp, {layout});
    at::Tensor y;
    {
      CommDebugMode mode;
      y = m->forward(xd);
      REQUIRE(mode.total_count() == 0);
    }
    REQUIRE(DTensor(y).placements() == Placements{Shard(1)});
    at::Tensor ref_y = ref->forward(x);
    REQUIRE(close(full_value(y), ref_y.detach(), 1e-4, 1e-5));
    // The weight and bias gradients come back Partial; full_tensor() reduces them.
    y.pow(2).sum().backward();
    ref_y.pow(2).sum().backward();
    require_same_grads(*m, *ref);
  }
}

TEST_CASE("parallelize_module: column/row-wise MLP trains like the plain MLP",
          "[tensor_parallel][world1][world2][world4]") {
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  torch::manual_seed(5);
  dtensor::models::MLP ref(8);
  ref->to(options().device());
  torch::manual_seed(5);
  dtensor::models::MLP mlp(8);
  mlp->to(options().device());
  dtensor::ParallelizePlan plan{{"in_proj", std::make_shared<dtensor::ColwiseParallel>()},
                                {"out_proj", std::make_shared<dtensor::RowwiseParallel>()}};
  dtensor::parallelize_module(*mlp, tp, plan);
  REQUIRE(DTensor(mlp->in_proj->weight).placements() == Placements{Shard(0)});
  REQUIRE(DTensor(mlp->in_proj->bias).placements() == Placements{Shard(0)});
  REQUIRE(DTensor(mlp->out_proj->weight).placements() == Placements{Shard(1)});
  REQUIRE(DTensor(mlp->out_proj->bias).placements() == Placements{Replicate()});
  torch::optim::SGD opt(mlp->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    opt.zero_grad();
    ref_opt.zero_grad();
    at::Tensor x = input({4, 8}, 50 + static_cast<uint64_t>(step));
    at::Tensor loss;
    {
      CommDebugMode mode;
      // The hidden activation stays sharded; out_proj's Partial result is reduced by the
      // relu that follows it: one all-reduce.
      loss = mlp->forward(x).sum();
      REQUIRE(mode.count("tp", CollectiveKind::AllReduce) == over(world(), 1));
      REQUIRE(mode.total_count() == over(world(), 1));
    }
    at::Tensor ref_loss = ref->forward(x).sum();
    REQUIRE(close(full_value(loss), ref_loss.detach(), 1e-4, 1e-5));
    loss.backward();
    ref_loss.backward();
    require_same_grads(*mlp, *ref);
    opt.step();
    ref_opt.step();
    require_same_params(*mlp, *ref);
  }
}

TEST_CASE("parallelize_module: TP on part of a model hands the plain rest plain tensors",
          "[tensor_parallel][world1][world2][world4]") {
  // RowwiseParallel's default use_local_output gives the plain Linear
  // after it a plain tensor ([Note: local outputs]), as in PyTorch.
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  auto make = [] {
    torch::manual_seed(7);
    torch::nn::Sequential m(torch::nn::Linear(16, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, 64), torch::nn::GELU(),
                            torch::nn::Linear(64, 8));
    m->to(options().device());
    return m;
  };
  auto ref = make();
  auto model = make();
  dtensor::parallelize_module(*model, tp,
                              {{"0", std::make_shared<dtensor::ColwiseParallel>()},
                               {"2", std::make_shared<dtensor::RowwiseParallel>()}});
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    opt.zero_grad();
    ref_opt.zero_grad();
    at::Tensor x = input({4, 16}, 60 + static_cast<uint64_t>(step));
    at::Tensor out;
    {
      CommDebugMode mode;
      out = model->forward(x);
      REQUIRE(mode.count("tp", CollectiveKind::AllReduce) == over(world(), 1)); // Rowwise's output
      REQUIRE(mode.total_count() == over(world(), 1));
    }
    REQUIRE_FALSE(dtensor::is_dtensor(out));
    at::Tensor ref_out = ref->forward(x);
    REQUIRE(close(out.detach(), ref_out.detach(), 1e-4, 1e-5));
    at::Tensor loss = out.pow(2).mean();
    at::Tensor ref_loss = ref_out.pow(2).mean();
    {
      CommDebugMode mode;
      loss.backward();
      REQUIRE(mode.total_count() == 0); // the input needs no gradient
    }
    ref_loss.backward();
    for (const auto& item : ref->named_parameters()) {
      INFO("gradient of " << item.key());
      const at::Tensor& p = model->named_parameters()[item.key()];
      const bool tp_param = item.key().rfind("4.", 0) != 0;
      REQUIRE(dtensor::is_dtensor(p) == tp_param);
      REQUIRE(dtensor::is_dtensor(p.grad()) == tp_param);
      REQUIRE(close(full_value(p.grad()), item.value().grad(), 1e-4, 1e-5));
    }
    opt.step();
    ref_opt.step();
    for (const auto& item : ref->named_parameters()) {
      INFO("parameter " << item.key());
      REQUIRE(close(full_value(model->named_parameters()[item.key()]).detach(),
                    item.value().detach(), 1e-4, 1e-5));
    }
  }
}

TEST_CASE("parallelize_module: errors", "[tensor_parallel][world1][world2][world4]") {
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  auto colwise = std::make_shared<dtensor::ColwiseParallel>();
  {
    dtensor::models::MLP mlp(8);
    mlp->to(options().device());
    dtensor::ParallelizePlan plan{{"no_such.*", colwise}};
    REQUIRE_THROWS_WITH(dtensor::parallelize_module(*mlp, tp, plan),
                        contains("matches no submodule"));
  }
  {
    auto ln = layer_norm(0);
    REQUIRE_THROWS_WITH(dtensor::parallelize_module(*ln, tp, colwise), contains("ColwiseParallel"));
    REQUIRE_THROWS_WITH(dtensor::parallelize_module(*ln, tp, colwise), contains("LayerNorm"));
    REQUIRE_FALSE(dtensor::is_dtensor(ln->weight));
  }
  {
    auto mesh2 = init_device_mesh(device_type(), {world(), 1}, {"dp", "tp"});
    auto lin = linear(16, 8, 0);
    REQUIRE_THROWS_WITH(dtensor::parallelize_module(*lin, mesh2, colwise), contains("1-D"));
  }
}
