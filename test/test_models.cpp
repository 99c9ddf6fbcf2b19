// common_fsdp.py's models with DTensor parameters laid out by hand the way tensor parallelism lays
// them out (in_proj column-wise, out_proj row-wise): outputs, gradients and AdamW steps equal
// the plain model's, with one all-reduce per MLP in forward.
#include <torch/optim/adamw.h>

#include "support/prelude.h"
#include <models/mlp_models.h>

namespace {

void set(at::Tensor& p, const dtensor::DeviceMesh& mesh, Placement placement) {
  torch::NoGradGuard no_grad;
  p.set_data(dtensor::distribute_tensor(p.detach(), mesh, {placement}));
}

// Column-wise in_proj (weight and bias Shard(0)), row-wise out_proj (weight Shard(1), bias
// Replicate): the hidden activation stays sharded, out_proj leaves a Partial sum that the
// following relu reduces with one all-reduce.
void tensor_parallel(dtensor::models::MLPImpl& mlp, const dtensor::DeviceMesh& mesh) {
  set(mlp.in_proj->weight, mesh, Placement::shard(0));
  set(mlp.in_proj->bias, mesh, Placement::shard(0));
  set(mlp.out_proj->weight, mesh, Placement::shard(1));
  set(mlp.out_proj->bias, mesh, Placement::replicate());
}

} // namespace

TEST_CASE("MLPStack with column/row-wise DTensor parameters matches the plain model",
          "[models][dtensor][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"tp"});
  torch::manual_seed(1);
  auto ref = dtensor::models::mlp_stack(16);
  ref->to(options().device());
  torch::manual_seed(1);
  auto model = dtensor::models::mlp_stack(16);
  for (size_t i = 0; i < 3; ++i) {
    auto* mlp = model[i]->as<dtensor::models::MLPImpl>();
    tensor_parallel(*mlp, mesh);
    REQUIRE(DTensor(mlp->in_proj->weight).placements()[0] == Placement::shard(0));
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.01));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.01));
  for (int step = 0; step < 3; ++step) {
    at::Tensor x = at::randn({2, 5, 16}, options());
    opt.zero_grad();
    ref_opt.zero_grad();
    CommDebugMode mode;
    // Sequential (AnyModule) checks the exact argument type: pass an at::Tensor, not a DTensor.
    at::Tensor input = dtensor::distribute_tensor(x, mesh, {Placement::replicate()});
    at::Tensor y = model->forward(input);
    // Forward: one all-reduce per MLP (the row-wise Partial before its relu); plus the
    // broadcast of distribute_tensor.
    REQUIRE(mode.count("tp", CollectiveKind::AllReduce) == over(world(), 3));
    at::Tensor ref_y = ref->forward(x);
    REQUIRE(DTensor(y).placements()[0] == Placement::replicate());
    REQUIRE(close(DTensor(y).full_tensor(), ref_y.detach(), 1e-4, 1e-5));
    y.pow(2).sum().backward();
    ref_y.pow(2).sum().backward();
    auto p = model->parameters();
    auto q = ref->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      REQUIRE(dtensor::is_dtensor(p[i].grad()));
      REQUIRE(close(DTensor(p[i].grad()).full_tensor(), q[i].grad(), 1e-4, 1e-5));
    }
    opt.step();
    ref_opt.step();
    for (size_t i = 0; i < p.size(); ++i) {
      REQUIRE(close(DTensor(p[i]).full_tensor(), q[i].detach(), 1e-4, 1e-5));
    }
  }
}

TEST_CASE("DoubleLinear with replicated DTensor parameters, second output unused",
          "[models][dtensor][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  torch::manual_seed(2);
  dtensor::models::DoubleLinear ref(8, true);
  ref->to(options().device());
  torch::manual_seed(2);
  dtensor::models::DoubleLinear model(8, true);
  for (auto& p : model->parameters()) {
    set(p, mesh, Placement::replicate());
  }
  at::Tensor x = at::randn({3, 8}, options());
  auto outs = model->forward(dtensor::distribute_tensor(x, mesh, {Placement::replicate()}));
  auto ref_outs = ref->forward(x);
  REQUIRE(outs.size() == 2);
  REQUIRE(close(DTensor(outs[1]).full_tensor(), ref_outs[1].detach(), 1e-4, 1e-5));
  outs[0].sum().backward(); // lin2 gets no gradient
  ref_outs[0].sum().backward();
  REQUIRE(close(DTensor(model->lin1->weight.grad()).full_tensor(), ref->lin1->weight.grad(), 1e-4, 1e-5));
  REQUIRE_FALSE(model->lin2->weight.grad().defined());
}
