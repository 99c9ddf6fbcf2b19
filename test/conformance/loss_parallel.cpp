// Scenario "loss_parallel" (sc_loss_parallel.py): cross_entropy on class-sharded logits under
// dtensor::LossParallel, on a 1-D mesh and on (dp, tp).
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>

#include "oracle.h"

namespace conformance::sc_loss_parallel {
namespace {

namespace F = torch::nn::functional;

at::Tensor loss_of(const Case& c, const at::Tensor& x, const at::Tensor& target) {
  if (c.str("kind") == "twice") {
    at::Tensor lp = F::log_softmax(x, F::LogSoftmaxFuncOptions(1));
    return F::nll_loss(lp, target) + lp.exp().pow(2).sum() * 0.01;
  }
  F::CrossEntropyFuncOptions o;
  const std::string r = c.str("reduction");
  if (r == "sum") {
    o.reduction(torch::kSum);
  } else if (r == "none") {
    o.reduction(torch::kNone);
  }
  if (c["weighted"].toBool()) {
    o.weight(c["weight"].toTensor());
  }
  return F::cross_entropy(x, target, o);
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string k = c.str("key");
    at::Tensor x;
    at::Tensor target = c["target"].toTensor();
    if (c.str("layout") == "1d") {
      x = dtensor::distribute_tensor(c["logits"].toTensor(), ctx.mesh({ctx.world}, {"x"}),
                                     {dtensor::Shard(1)});
    } else {
      auto mesh = ctx.mesh({2, 2}, {"dp", "tp"});
      x = dtensor::distribute_tensor(c["logits"].toTensor(), mesh,
                                     {dtensor::Shard(0), dtensor::Shard(1)});
      target = dtensor::distribute_tensor(target, mesh, {dtensor::Shard(0), dtensor::Replicate()});
    }
    x.requires_grad_(true);
    try {
      dtensor::LossParallel scope;
      at::Tensor loss;
      {
        dtensor::CommDebugMode forward;
        loss = loss_of(c, x, target);
        ctx.results.tensor(k + " loss#0", loss, &forward);
      }
      dtensor::CommDebugMode backward;
      loss.sum().backward();
      ctx.results.tensor(k + " grad#0", x.grad(), &backward);
    } catch (const std::exception& e) {
      ctx.results.error(k + " loss#0", e);
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("loss_parallel", run);

} // namespace
} // namespace conformance::sc_loss_parallel
