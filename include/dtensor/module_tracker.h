#pragma once

#include <dtensor/module_hooks.h>

namespace dtensor {

// [Note: module attribution] (lib/mesh/comm_debug_modules.cpp) PyTorch's CommDebugMode
// attributes collectives to the module running them through global module hooks. dtensor's
// are hooks on the module seam (dtensor/module_hooks.h), registered for every module and
// active while a CommDebugMode is: a module called through dtensor::call is current from its
// first pre-forward hook to its last post-forward hook, so the collectives of its
// tensor-parallel input and output conversions are its own, as in PyTorch.
//
// Names are PyTorch's: a module entered with no module open is a root, named by its class
// ("MLPModuleImpl" and "torch::nn::LinearImpl" print as "MLPModule" and "Linear"); every
// module under a root is named by its path from it ("MLPModule.net1", "Model.layers.0.attn"),
// found among the root's submodules.
//
// In backward, an output that requires grad gets a gradient hook that makes the module
// current (PyTorch's backward pre-hook); a tensor returned by a module and by its caller
// keeps the inner module's hook only.

// An alias of dtensor::call, kept for code written before the module seam.
template <typename M, typename... Args>
auto traced_forward(M& module, Args&&... args) {
  return call(module, std::forward<Args>(args)...);
}

} // namespace dtensor
