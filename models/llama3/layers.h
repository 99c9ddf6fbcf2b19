#pragma once

// The Llama-3 model's layers that other models' blocks share (the mixture-of-experts layer's
// shared experts, models/moe/moe.h): bias-free Linears, RMSNorm and the SwiGLU feed-forward.
#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <dtensor/module_hooks.h>
#include <dtensor/random.h>

namespace dtensor::models {

namespace llama3_detail {

inline torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

} // namespace llama3_detail

// x * rsqrt(mean(x^2) + eps) computed in fp32 and cast back to x's dtype, times `weight`
// (Hugging Face's LlamaRMSNorm, torchtitan's former RMSNorm). A module of its own, not a
// Linear, so SequenceParallel accepts it.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps_)
      : eps(eps_), weight(register_parameter("weight", torch::ones({dim}))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x.to(at::kFloat);
    h = h * at::rsqrt(h.pow(2).mean({-1}, /*keepdim=*/true) + eps);
    return h.to(x.scalar_type()) * weight;
  }
  void reset_parameters() {
    torch::NoGradGuard no_grad;
    weight.fill_(1.0);
  }
  double eps;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

// SwiGLU: w2(silu(w1 x) * w3 x), w1 / w3 dim -> hidden_dim, w2 back.
struct Llama3FeedForwardImpl : torch::nn::Module {
  Llama3FeedForwardImpl(int64_t dim, int64_t hidden_dim)
      : w1(register_module("w1", llama3_detail::linear(dim, hidden_dim))),
        w2(register_module("w2", llama3_detail::linear(hidden_dim, dim))),
        w3(register_module("w3", llama3_detail::linear(dim, hidden_dim))) {}
  at::Tensor forward(const at::Tensor& x) {
    return dtensor::call(w2, at::silu(dtensor::call(w1, x)) * dtensor::call(w3, x));
  }
  // torchtitan: w1 trunc_normal_(std 0.02), w2 / w3 trunc_normal_(init_std).
  void init_weights(double init_std) {
    torch::NoGradGuard no_grad;
    dtensor::trunc_normal_(w1->weight, 0.0, 0.02);
    dtensor::trunc_normal_(w2->weight, 0.0, init_std);
    dtensor::trunc_normal_(w3->weight, 0.0, init_std);
  }
  torch::nn::Linear w1;
  torch::nn::Linear w2;
  torch::nn::Linear w3;
};
TORCH_MODULE(Llama3FeedForward);

} // namespace dtensor::models
