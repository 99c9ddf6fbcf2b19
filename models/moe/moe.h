#pragma once

// A mixture-of-experts layer after torchtitan's models/common/moe.py: a token-choice top-k
// router (softmax or sigmoid scores in fp32, node-limited expert groups, optional route
// normalisation and scale), routed experts as grouped SwiGLU weights [E, F, D] computed with
// one grouped matrix product per projection (at::_grouped_mm), shared experts, and the
// auxiliary-loss-free load balancing bias (models/moe/load_balance.h). docs/moe.md.
//
// [Note: models carry no parallelism] in models/llama3/model.h holds here too: expert
// parallelism (dtensor::ExpertParallel) registers on the experts' and the router's calls from
// outside. The one concession is GroupedExperts' forward, a local region
// (dtensor::local_map): with its weights sharded by expert it computes on the local experts,
// as torchtitan's RoutedExperts does; on one process it is the plain computation.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <dtensor/module_hooks.h>
#include <dtensor/random.h>
#include <dtensor/user_rules.h>

#include <models/check.h>
#include <models/llama3/layers.h>
#include <models/moe/args.h>

namespace dtensor::models {

namespace moe_detail {

// x [N, I] @ w[e]^T for the rows of each expert (counts[e] rows, in order; rows past them are
// padding, their outputs undefined): [N, O]. One
// at::_grouped_mm where its kernels take the strides (rows of 16-byte multiples, which every
// configured model has); otherwise one matmul per expert, the same values.
inline at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
  DTENSOR_MODEL_CHECK(x.scalar_type() == w.scalar_type(), "GroupedExperts: rows are ",
                      x.scalar_type(), " but the expert weights ", w.scalar_type());
  const int64_t in_bytes = w.size(2) * static_cast<int64_t>(w.element_size());
  const int64_t out_bytes = w.size(1) * static_cast<int64_t>(w.element_size());
  if (in_bytes % 16 == 0 && out_bytes % 16 == 0) {
    return at::_grouped_mm(x, w.transpose(-2, -1), counts.cumsum(0).to(at::kInt));
  }
  at::Tensor host = counts.to(at::kCPU);
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t e = 0; e < w.size(0); ++e) {
    const int64_t n = host[e].item<int64_t>();
    parts.push_back(at::matmul(x.narrow(0, start, n), w[e].t()));
    start += n;
  }
  // Rows past the groups (expert parallelism's capacity padding) get zeros.
  parts.push_back(at::zeros({x.size(0) - start, w.size(1)}, x.options()));
  return at::cat(parts, 0);
}

// SwiGLU per expert: w2(silu(w1 x) * w3 x).
inline at::Tensor grouped_swiglu(const at::Tensor& x, const at::Tensor& counts,
                                 const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3) {
  DTENSOR_MODEL_CHECK(counts.numel() == w1.size(0), "GroupedExperts: counts for ", counts.numel(),
                      " experts, weights for ", w1.size(0));
  at::Tensor h = at::silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts);
  return grouped_mm(h, w2, counts);
}

} // namespace moe_detail

// Scores of every expert for every token, the top-k choice, and the rows per expert.
// forward(x [T, D], expert_bias [E] or undefined) -> (scores [T, K] fp32, experts [T, K]
// int64, counts [E] int64). The gate runs in fp32 (torchtitan's RouterGateLinear); the bias
// changes which experts are chosen, not their scores.
struct TokenChoiceTopKRouterImpl : torch::nn::Module {
  explicit TokenChoiceTopKRouterImpl(const MoEArgs& a)
      : args(a),
        gate(register_module(
            "gate",
            torch::nn::Linear(torch::nn::LinearOptions(a.dim(), a.num_experts()).bias(false)))) {
    DTENSOR_MODEL_CHECK(a.top_k() >= 1 && a.top_k() <= a.num_experts(), "MoE: top_k ", a.top_k(),
                        " must be in [1, num_experts = ", a.num_experts(), "]");
    DTENSOR_MODEL_CHECK(
        a.num_expert_groups() >= 1 && a.num_experts() % a.num_expert_groups() == 0 &&
            a.num_limited_groups() >= 1 && a.num_limited_groups() <= a.num_expert_groups(),
        "MoE: ", a.num_experts(), " experts in ", a.num_expert_groups(), " groups, ",
        a.num_limited_groups(), " of them chosen: not a valid split");
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x,
                                                         const at::Tensor& expert_bias) {
    // The gate in float32, from the weight as the forward sees it: a copy even when the
    // weight is float32 already, so that under fully_shard's mixed precision it is the
    // unsharded parameter's (bf16) values upcast, as FSDP2 computes it (a no-op .to would
    // hand the op the bf16 weight beside a float32 input).
    at::Tensor logits = at::linear(x.to(at::kFloat), gate->weight.to(at::kFloat, false, true));
    at::Tensor scores =
        args.score_func() == MoEScore::Softmax ? at::softmax(logits, -1) : at::sigmoid(logits);
    at::Tensor choice = expert_bias.defined() ? scores.detach() + expert_bias : scores.detach();
    choice = limit_groups(choice);
    at::Tensor experts = std::get<1>(at::topk(choice, args.top_k(), -1));
    at::Tensor top = scores.gather(-1, experts);
    if (args.route_norm()) {
      top = top / (top.sum(-1, /*keepdim=*/true) + 1e-20);
    }
    top = top * args.route_scale();
    // Rows per expert: a scatter into [E] (bincount's shape depends on the values, which a
    // simulated rank does not have; this one's is [E] on any device).
    const at::Tensor flat = experts.flatten();
    at::Tensor counts =
        at::zeros({args.num_experts()}, flat.options()).scatter_add_(0, flat, at::ones_like(flat));
    return {top, experts, counts};
  }
  // Experts outside a token's best num_limited_groups groups get -inf (never chosen).
  at::Tensor limit_groups(const at::Tensor& choice) const {
    const int64_t groups = args.num_expert_groups();
    if (groups == 1 || args.num_limited_groups() == groups) {
      return choice;
    }
    const int64_t t = choice.size(0), per = args.num_experts() / groups;
    at::Tensor grouped = choice.view({t, groups, per});
    at::Tensor group_score = std::get<0>(grouped.topk(std::min<int64_t>(2, per), -1)).sum(-1);
    at::Tensor keep = std::get<1>(group_score.topk(args.num_limited_groups(), -1));
    at::Tensor mask =
        at::ones({t, groups}, choice.options().dtype(at::kBool)).scatter_(1, keep, false);
    return grouped.masked_fill(mask.unsqueeze(-1), -std::numeric_limits<double>::infinity())
        .view({t, args.num_experts()});
  }
  MoEArgs args;
  torch::nn::Linear gate;
};
TORCH_MODULE(TokenChoiceTopKRouter);

// Routed experts: w1 / w3 [E, F, D], w2 [E, D, F]. forward(x [N, D], counts [E]) takes rows
// grouped by expert in expert order and returns each row's expert output [N, D].
struct GroupedExpertsImpl : torch::nn::Module {
  GroupedExpertsImpl(int64_t dim, int64_t hidden_dim, int64_t num_experts)
      : w1(register_parameter("w1", torch::empty({num_experts, hidden_dim, dim}))),
        w2(register_parameter("w2", torch::empty({num_experts, dim, hidden_dim}))),
        w3(register_parameter("w3", torch::empty({num_experts, hidden_dim, dim}))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& counts) {
    static const dtensor::LocalFn local = dtensor::local_map(
        [](const std::vector<at::Tensor>& t) -> std::vector<at::Tensor> {
          return {moe_detail::grouped_swiglu(t[0], t[1], t[2], t[3], t[4])};
        },
        dtensor::LocalMapOptions().out_placements({std::nullopt}));
    return local({x, counts, w1, w2, w3})[0];
  }
  // torchtitan: w1 trunc_normal_(std 0.02), w2 / w3 trunc_normal_(init_std).
  void init_weights(double init_std) {
    torch::NoGradGuard no_grad;
    dtensor::trunc_normal_(w1, 0.0, 0.02);
    dtensor::trunc_normal_(w2, 0.0, init_std);
    dtensor::trunc_normal_(w3, 0.0, init_std);
  }
  at::Tensor w1, w2, w3;
};
TORCH_MODULE(GroupedExperts);

// forward(x [..., D]) -> [..., D]: the router's top-k experts' outputs weighted by their
// scores (in fp32), plus the shared experts'. Shared experts run before the routed ones, so
// that an exchange of counts started when the router returns (expert parallelism) overlaps
// them. In training the rows per expert add up in tokens_per_expert (for the bias update).
struct MoEImpl : torch::nn::Module {
  explicit MoEImpl(const MoEArgs& a)
      : args(a), router(register_module("router", TokenChoiceTopKRouter(a))),
        experts(
            register_module("experts", GroupedExperts(a.dim(), a.hidden_dim(), a.num_experts()))) {
    if (a.num_shared_experts() > 0) {
      shared_experts = register_module(
          "shared_experts", Llama3FeedForward(a.dim(), a.hidden_dim() * a.num_shared_experts()));
    }
    if (a.load_balance_coeff()) {
      DTENSOR_MODEL_CHECK(*a.load_balance_coeff() > 0, "MoE: load_balance_coeff must be > 0");
      expert_bias = register_buffer("expert_bias", torch::zeros({a.num_experts()}));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t d = x.size(-1);
    at::Tensor rows = x.reshape({-1, d});
    auto [scores, chosen, counts] = dtensor::call(router, rows, expert_bias);
    if (is_training() && expert_bias.defined()) {
      torch::NoGradGuard no_grad;
      if (!tokens_per_expert.defined()) {
        tokens_per_expert = torch::zeros_like(expert_bias);
      }
      tokens_per_expert.add_(counts);
    }
    at::Tensor shared;
    if (shared_experts) {
      shared = dtensor::call(shared_experts, rows);
    }
    // The T*K (token, choice) pairs in expert order (stable: by token within an expert).
    at::Tensor order =
        std::get<1>(at::sort(chosen.flatten(), std::optional<bool>(true), 0, /*descending=*/false));
    at::Tensor token = order.div(args.top_k(), "floor");
    at::Tensor routed = dtensor::call(experts, rows.index_select(0, token), counts);
    at::Tensor weighted =
        (routed.to(at::kFloat) * scores.flatten().index_select(0, order).unsqueeze(1))
            .to(rows.scalar_type());
    at::Tensor out = at::zeros_like(rows).index_add(0, token, weighted);
    if (shared.defined()) {
      out = out + shared;
    }
    return out.view(x.sizes());
  }
  // torchtitan: the gate and w1 trunc_normal_(std 0.02), w2 / w3 and the shared experts'
  // with init_std; the bias and the counts zero.
  void init_weights(double init_std) {
    torch::NoGradGuard no_grad;
    dtensor::trunc_normal_(router->gate->weight, 0.0, 0.02);
    experts->init_weights(init_std);
    if (shared_experts) {
      shared_experts->init_weights(init_std);
    }
    if (expert_bias.defined()) {
      expert_bias.zero_();
    }
    tokens_per_expert = at::Tensor();
  }
  MoEArgs args;
  TokenChoiceTopKRouter router;
  GroupedExperts experts;
  Llama3FeedForward shared_experts{nullptr};
  at::Tensor expert_bias;       // registered buffer [E] fp32 (persistent, as torchtitan's)
  at::Tensor tokens_per_expert; // [E] fp32, not a buffer (torchtitan's is not persistent)
};
TORCH_MODULE(MoE);

} // namespace dtensor::models
