#pragma once

#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace dtensor {

// [Note: module attribution] (lib/mesh/comm_debug_modules.cpp) PyTorch's CommDebugMode
// attributes collectives to the module running them through global module hooks, and its
// tensor-parallel styles convert module outputs in forward hooks. C++ modules have no hooks,
// so a model marks its modules' forwards: each submodule call goes through
// traced_forward(submodule, args...) (or a ModuleScope around it, declaring the outputs).
//
// Names are PyTorch's: a module entered with no scope open is a root, named by its class
// ("MLPModuleImpl" and "torch::nn::LinearImpl" print as "MLPModule" and "Linear"); every
// module under a root is named by its path from it ("MLPModule.net1", "Model.layers.0.attn"),
// found among the root's submodules.
//
// Declaring an output (output(); traced_forward does it when forward returns) is the
// module's forward hook, with or without a CommDebugMode:
//  - a tensor-parallel module's output is converted as PyTorch's output hook converts it:
//    redistributed to the style's output layout (RowwiseParallel's all-reduce), above
//    autograd, and with use_local_output and a Replicate layout handed over as the local
//    tensor; without traced_forward the ops convert it when it is first used
//    ([Note: tensor parallelism without module hooks]): the same values and collectives;
//  - while a CommDebugMode is active, an output that requires grad gets a gradient hook that
//    makes the module current in backward (PyTorch's backward pre-hook).
// With no CommDebugMode active and no tensor parallelism a scope costs a thread-local lookup
// and one tag lookup per output.
class ModuleScope {
 public:
  explicit ModuleScope(const torch::nn::Module& module);
  ~ModuleScope();
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;
  // Declares one of the module's outputs once the module is done with it; returns what the
  // caller gets (see above).
  at::Tensor output(const at::Tensor& t);
  bool active() const { return active_; }

 private:
  const torch::nn::Module* module_;
  bool active_ = false;
  std::string name_;
};

namespace detail {
template <typename T>
T declare_outputs(ModuleScope&, const T& v) { // not a tensor: nothing to declare
  return v;
}
inline at::Tensor declare_outputs(ModuleScope& scope, const at::Tensor& t) {
  return scope.output(t);
}
inline std::vector<at::Tensor> declare_outputs(ModuleScope& scope, const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) {
    out.push_back(scope.output(t));
  }
  return out;
}
template <typename... T>
std::tuple<T...> declare_outputs(ModuleScope& scope, const std::tuple<T...>& ts) {
  return std::apply([&](const auto&... t) { return std::tuple<T...>(declare_outputs(scope, t)...); }, ts);
}
} // namespace detail

// Calls module->forward(args...) inside a ModuleScope and returns its outputs as declared (a
// tensor, a vector or a tuple of them; anything else unchanged):
//   auto h = dtensor::traced_forward(net1, x);
template <typename M, typename... Args>
auto traced_forward(M& module, Args&&... args) {
  ModuleScope scope(*module);
  auto out = module->forward(std::forward<Args>(args)...);
  return detail::declare_outputs(scope, out);
}

} // namespace dtensor
