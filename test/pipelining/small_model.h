#pragma once

// The small model of the pipelining tests (test_pipelining.cpp, test_pipeline_checks.cpp):
// eight Linear + tanh layers cut into stages, its losses, and this rank's stages of it.
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/modules/linear.h>

#include <dtensor/pipelining.h>

#include "support/prelude.h"

namespace pipeline_test {

inline constexpr int kWidth = 8;
inline constexpr int kBatch = 16;

// The model: 8 layers of Linear + tanh, the last without tanh; each stage holds
// 8 / num_stages consecutive layers.
struct Model {
  std::vector<torch::nn::Linear> layers;

  explicit Model(int seed) {
    torch::manual_seed(seed);
    for (int i = 0; i < 8; ++i) {
      layers.emplace_back(kWidth, kWidth);
    }
  }

  at::Tensor run(at::Tensor x, int from, int to) {
    for (int i = from; i < to; ++i) {
      x = layers[i]->forward(x);
      if (i != 7) {
        x = at::tanh(x);
      }
    }
    return x;
  }
};

inline at::Tensor sum_loss(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).sum() / static_cast<double>(kBatch); // over the global count
}

inline at::Tensor mean_loss(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).mean();
}

// A sum loss over the global count needs no division afterwards: PyTorch's scale_grads=False.
inline const auto kSumLoss = dtensor::PipelineOptions().scale_grads(false);

// This rank's stages of `model`, as the schedule places them.
inline std::vector<dtensor::PipelineStage> stages_of(Model& model,
                                                     const dtensor::PipelineOrder& order,
                                                     int num_stages, int microbatches = 8,
                                                     int pp_rank = rank()) {
  auto placement = dtensor::validate_schedule(order, num_stages, microbatches);
  int per = 8 / num_stages;
  std::vector<dtensor::PipelineStage> out;
  for (int s = 0; s < num_stages; ++s) {
    if (placement[s] != pp_rank) {
      continue;
    }
    auto holder = std::make_shared<torch::nn::Module>();
    for (int i = s * per; i < (s + 1) * per; ++i) {
      holder->register_module("layer" + std::to_string(i), model.layers[i]);
    }
    out.push_back({s, holder, [&model, s, per](const at::Tensor& x) {
                     return model.run(x, s * per, (s + 1) * per);
                   }});
  }
  return out;
}

} // namespace pipeline_test
