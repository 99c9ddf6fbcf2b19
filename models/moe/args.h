#pragma once

// The mixture-of-experts layer's arguments (torchtitan's MoEArgs in models/common/moe.py),
// apart from the layer (models/moe/moe.h) so that a model's arguments can hold them.
#include <cstdint>
#include <optional>

#include <torch/arg.h>

namespace dtensor::models {

enum class MoEScore { Softmax, Sigmoid };

struct MoEArgs {
  TORCH_ARG(int64_t, dim) = 64;
  TORCH_ARG(int64_t, hidden_dim) = 32; // each routed expert's SwiGLU hidden size
  TORCH_ARG(int64_t, num_experts) = 8;
  TORCH_ARG(int64_t, top_k) = 2;
  TORCH_ARG(int64_t, num_shared_experts) = 0; // shared SwiGLU of hidden_dim x this
  TORCH_ARG(MoEScore, score_func) = MoEScore::Softmax;
  TORCH_ARG(bool, route_norm) = false; // top-k scores divided by their sum (+1e-20)
  TORCH_ARG(double, route_scale) = 1.0;
  // Node-limited routing (DeepSeek-V3): experts in num_expert_groups groups, a token's choice
  // restricted to the num_limited_groups groups whose two best (biased) scores sum highest.
  TORCH_ARG(int64_t, num_expert_groups) = 1;
  TORCH_ARG(int64_t, num_limited_groups) = 1;
  // The load-balancing bias (unset: none; models/moe/load_balance.h).
  TORCH_ARG(std::optional<double>, load_balance_coeff) = 1e-3;
};

} // namespace dtensor::models
