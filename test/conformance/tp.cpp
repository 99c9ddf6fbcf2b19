// Scenario "tp" (sc_tp.py): parallelize_module plans on part of a model, distribute_module,
// and FSDP x TP with hand-distributed parameters, trained for a few SGD steps.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "oracle.h"

namespace conformance::sc_tp {
namespace {

using dtensor::DTensor;
using dtensor::Placement;

std::shared_ptr<torch::nn::Module> seq_model() {
  torch::manual_seed(7);
  // One statement per layer: the initial values follow the order of creation, which the
  // arguments of one call would leave unspecified.
  torch::nn::Linear l0(16, 64);
  torch::nn::Linear l2(64, 64);
  torch::nn::Linear l4(64, 8);
  torch::nn::Sequential m(l0, torch::nn::ReLU(), l2, torch::nn::GELU(), l4);
  return m.ptr();
}

torch::nn::Linear linear_model() {
  torch::manual_seed(3);
  return torch::nn::Linear(8, 6);
}

struct Built {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
};

Built build_tp(Ctx& ctx, const Case& c) {
  auto model = seq_model();
  auto mesh = ctx.mesh({ctx.world}, {"tp"});
  const std::string plan = c.str("plan");
  const bool local = plan == "default";
  auto row = dtensor::RowwiseParallel().use_local_output(local);
  if (plan == "rowwise_shard0") {
    row.output_layouts(Placement::shard(0));
  }
  dtensor::parallelize_module(*model, mesh,
                              {{"0", std::make_shared<dtensor::ColwiseParallel>(
                                         dtensor::ColwiseParallel().use_local_output(local))},
                               {"2", std::make_shared<dtensor::RowwiseParallel>(row)}});
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model);
  return {model, [seq](const at::Tensor& x) { return seq->forward(x); }};
}

Built build_distribute_module(Ctx& ctx) {
  auto lin = linear_model();
  auto mesh = ctx.mesh({ctx.world}, {"tp"});
  dtensor::distribute_module(
      *lin, mesh, [](const std::string&, torch::nn::Module& m, const dtensor::DeviceMesh& mm) {
        if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(&m)) {
          torch::NoGradGuard no_grad;
          l->weight.set_data(
              dtensor::distribute_tensor(l->weight.detach(), mm, {Placement::shard(0)}));
        }
      });
  return {lin.ptr(), [lin, mesh](const at::Tensor& x) mutable {
            return lin->forward(DTensor::from_local(x, mesh, {Placement::replicate()}));
          }};
}

Built build_fsdp_tp_hand(Ctx& ctx, const Case& c) {
  auto lin = linear_model();
  auto mesh = ctx.mesh(c.ints("mesh"), {"dp", "tp"});
  auto tp = mesh["tp"];
  const Placement p = placement(c.str("placement"));
  {
    torch::NoGradGuard no_grad;
    lin->weight.set_data(dtensor::distribute_tensor(lin->weight.detach(), tp, {p}));
    lin->bias.set_data(dtensor::distribute_tensor(lin->bias.detach(), tp, {p}));
  }
  dtensor::fully_shard(*lin, dtensor::FullyShardOptions().mesh(mesh["dp"]));
  for (const auto& item : lin->named_parameters()) {
    ctx.results.tensor(c.str("key") + " sharded " + item.key() + "#0", item.value());
  }
  return {lin.ptr(), [lin, tp](const at::Tensor& x) mutable {
            return lin->forward(DTensor::from_local(x, tp, {Placement::replicate()}));
          }};
}

void run_case(Ctx& ctx, const Case& c) {
  {
    const std::string key = c.str("key");
    const std::string kind = c.str("kind");
    Built b = kind == "tp"                  ? build_tp(ctx, c)
              : kind == "distribute_module" ? build_distribute_module(ctx)
                                            : build_fsdp_tp_hand(ctx, c);
    torch::optim::SGD opt(b.module->parameters(), torch::optim::SGDOptions(0.1));
    const c10::IValue inputs = c["inputs"];
    int64_t step = 0;
    for (const c10::IValue& xv : inputs.toListRef()) {
      const std::string k = key + " step" + std::to_string(step++);
      opt.zero_grad();
      at::Tensor out;
      {
        dtensor::CommDebugMode fwd;
        out = b.forward(xv.toTensor());
        ctx.results.tensor(k + " out#0", out, &fwd);
      }
      at::Tensor loss = kind == "tp" ? out.pow(2).mean() : out.pow(2).sum();
      ctx.results.tensor(k + " loss#0", loss);
      {
        dtensor::CommDebugMode bwd;
        loss.backward();
        ctx.results.counts(k + " backward#0", bwd);
      }
      ctx.results.step(k, *b.module, opt);
    }
  }
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    try {
      run_case(ctx, c);
    } catch (const std::exception& e) {
      ctx.results.error(c.str("key") + "#error", e);
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("tp", run);

} // namespace
} // namespace conformance::sc_tp
