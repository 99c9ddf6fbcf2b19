// Scenario "pipelining" (sc_pipelining.py): every schedule on the model of eight Linear + tanh
// layers cut into stages, against PyTorch's torch.distributed.pipelining on the same ranks.
#include <torch/nn/modules/linear.h>

#include "oracle.h"

namespace conformance::sc_pipelining {
namespace {

constexpr int kLayers = 8;
constexpr int kWidth = 8;
constexpr double kBatch = 16;

int stages_per_rank(dtensor::ScheduleKind k) {
  return k == dtensor::ScheduleKind::GPipe || k == dtensor::ScheduleKind::OneFOneB ? 1 : 2;
}

at::Tensor sum_loss(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).sum() / kBatch;
}

at::Tensor mean_loss(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).mean();
}

// Layers [first, last) under their names in the whole model ("layers.3.weight").
std::shared_ptr<torch::nn::Module> part(const std::vector<torch::nn::Linear>& layers, int first,
                                        int last) {
  auto m = std::make_shared<torch::nn::Module>("Part");
  auto holder = m->register_module("layers", std::make_shared<torch::nn::Module>());
  for (int i = first; i < last; ++i) {
    holder->register_module(std::to_string(i), layers[static_cast<size_t>(i)]);
  }
  return m;
}

at::Tensor run_layers(std::vector<torch::nn::Linear> layers, at::Tensor x, int first, int last) {
  for (int i = first; i < last; ++i) {
    x = layers[static_cast<size_t>(i)]->forward(x);
    if (i != kLayers - 1) {
      x = at::tanh(x);
    }
  }
  return x;
}

void run_case(Ctx& ctx, const Case& c) {
  const std::string k = c.str("key");
  const auto kind = dtensor::schedule_kind(c.str("schedule")); // sc_pipelining.py's names
  const int m = static_cast<int>(c["microbatches"].toInt());
  const int per_rank = stages_per_rank(kind);
  const int world = static_cast<int>(ctx.world);
  const int num_stages = world * per_rank;
  const int per_stage = kLayers / num_stages;
  std::vector<torch::nn::Linear> layers;
  for (int i = 0; i < kLayers; ++i) {
    layers.emplace_back(kWidth, kWidth);
  }
  load_init(*part(layers, 0, kLayers), c);
  const auto order = dtensor::generate_schedule(kind, world, m, per_rank);
  const auto placement = dtensor::validate_schedule(order, num_stages, m);
  std::vector<dtensor::PipelineStage> stages;
  for (int s = 0; s < num_stages; ++s) {
    if (placement[static_cast<size_t>(s)] == ctx.rank) {
      const int first = s * per_stage, last = (s + 1) * per_stage;
      stages.push_back({s, part(layers, first, last), [layers, first, last](const at::Tensor& x) {
                          return run_layers(layers, x, first, last);
                        }});
    }
  }
  auto pp = ctx.mesh({ctx.world}, {"pp"}).get_group();
  // The mean loss with the default (PyTorch's scale_grads=True), the sum loss without it.
  const bool mean = c.str("loss") == "mean";
  dtensor::PipelineSchedule schedule(stages, pp, order, m, mean ? mean_loss : sum_loss,
                                     mean ? dtensor::PipelineOptions()
                                          : dtensor::PipelineOptions().scale_grads(false));
  const auto losses = schedule.step(c["input"].toTensor(), c["target"].toTensor());
  for (size_t j = 0; j < losses.size(); ++j) {
    ctx.results.tensor(k + " loss mb" + std::to_string(j) + "#0", losses[j]);
  }
  for (const auto& st : stages) {
    for (const auto& p : st.module->named_parameters()) {
      ctx.results.tensor(k + " grad " + p.key() + "#0", p.value().grad());
    }
  }
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    run_case(ctx, c);
  }
}

[[maybe_unused]] const bool registered = register_scenario("pipelining", run);

} // namespace
} // namespace conformance::sc_pipelining
