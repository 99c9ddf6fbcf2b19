#pragma once

// C++ ports of models of PyTorch's torch/testing/_internal/distributed/_tensor/common_dtensor.py
// (and the stack of them the conformance scenario "debug" uses), whose forwards call their
// submodules through dtensor::call (the module seam), so CommDebugMode sees them as PyTorch's tracker
// sees the Python ones ([Note: module attribution]).
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <dtensor/module_hooks.h>

namespace dtensor::models {

// net1 (10 -> 16), relu, net2 (16 -> 10); parameters drawn after torch::manual_seed(seed).
struct MLPModuleImpl : torch::nn::Module {
  explicit MLPModuleImpl(uint64_t seed = 5) {
    torch::manual_seed(seed);
    net1 = register_module("net1", torch::nn::Linear(10, 16));
    relu = register_module("relu", torch::nn::ReLU());
    net2 = register_module("net2", torch::nn::Linear(16, 10));
  }
  at::Tensor forward(const at::Tensor& x) {
    return call(net2, call(relu, call(net1, x)));
  }
  torch::nn::Linear net1{nullptr}, net2{nullptr};
  torch::nn::ReLU relu{nullptr};
};
TORCH_MODULE(MLPModule);

// layers: MLPModule(5), MLPModule(6); output: Linear(10 -> 4) after torch::manual_seed(7).
struct MLPModuleStackImpl : torch::nn::Module {
  MLPModuleStackImpl() {
    layers = register_module("layers", torch::nn::ModuleList(MLPModule(5), MLPModule(6)));
    torch::manual_seed(7);
    output = register_module("output", torch::nn::Linear(10, 4));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& layer : *layers) {
      auto mlp = MLPModule(std::dynamic_pointer_cast<MLPModuleImpl>(layer));
      x = call(mlp, x);
    }
    return call(output, x);
  }
  torch::nn::ModuleList layers{nullptr};
  torch::nn::Linear output{nullptr};
};
TORCH_MODULE(MLPModuleStack);

} // namespace dtensor::models
