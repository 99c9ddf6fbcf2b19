#pragma once

// C++ ports of the models of PyTorch's torch/testing/_internal/common_fsdp.py
// used by the tests. Only what the tests need so far: MLP, MLPStack, DoubleLinear.
#include <torch/nn/functional/activation.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace dtensor::models {

// in_proj (dim -> multiplier * dim), relu, out_proj (-> dim), relu, optional buffer add.
struct MLPImpl : torch::nn::Module {
  MLPImpl(int64_t dim, bool bias = true, bool with_buffer = false, int64_t dim_multiplier = 4)
      : in_proj(register_module("in_proj", torch::nn::Linear(torch::nn::LinearOptions(dim, dim_multiplier * dim).bias(bias)))),
        out_proj(register_module("out_proj", torch::nn::Linear(torch::nn::LinearOptions(dim_multiplier * dim, dim).bias(bias)))) {
    if (with_buffer) {
      buffer = register_buffer("buffer", torch::randn({dim}));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto z = torch::relu(in_proj->forward(x));
    z = torch::relu(out_proj->forward(z));
    return buffer.defined() ? z + buffer : z;
  }
  torch::nn::Linear in_proj;
  torch::nn::Linear out_proj;
  torch::Tensor buffer;
};
TORCH_MODULE(MLP);

// MLP(dim, x3), MLP(dim), MLP(dim, x3) [, LayerNorm(dim, no bias) with sequence parallel].
inline torch::nn::Sequential mlp_stack(int64_t dim, bool with_seq_parallel = false) {
  torch::nn::Sequential s(MLP(dim, true, false, 3), MLP(dim), MLP(dim, true, false, 3));
  if (with_seq_parallel) {
    s->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).elementwise_affine(true)));
  }
  return s;
}

// Two linears on the same input; the second may be left unused.
struct DoubleLinearImpl : torch::nn::Module {
  DoubleLinearImpl(int64_t dim, bool use_second_linear = true)
      : lin1(register_module("lin1", torch::nn::Linear(dim, dim))),
        lin2(register_module("lin2", torch::nn::Linear(dim, dim))), use_second(use_second_linear) {}
  std::vector<torch::Tensor> forward(const torch::Tensor& x) {
    if (use_second) {
      return {torch::relu(lin1->forward(x)), torch::relu(lin2->forward(x))};
    }
    return {torch::relu(lin1->forward(x))};
  }
  torch::nn::Linear lin1;
  torch::nn::Linear lin2;
  bool use_second;
};
TORCH_MODULE(DoubleLinear);

} // namespace dtensor::models
