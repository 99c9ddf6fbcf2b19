#pragma once

// The shared_ptr that owns a torch::nn::Module, for APIs that keep or walk the module.
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "internal/check.h"

namespace dtensor::detail {

// A module on the stack (or otherwise not owned by a shared_ptr) would make
// shared_from_this() throw std::bad_weak_ptr: name the API and the module instead.
inline std::shared_ptr<torch::nn::Module> owned_module(torch::nn::Module& module, const char* api) {
  try {
    return module.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    DTENSOR_FAIL("{}({}): the module must be owned by a std::shared_ptr (a TORCH_MODULE holder, "
                 "std::make_shared, or a submodule registered with register_module)",
                 api, module.name());
  }
}

// [Note: children of a Sequential] torch::nn::Sequential's forward calls each child's
// forward itself, so a hook registered on a child never runs: the Sequential is the caller,
// and it does not call through dtensor::call. fully_shard and tensor parallelism have op-level
// fallbacks for such calls ([Note: the fallback trigger] in docs/architecture.md); a subsystem
// that acts only on module calls (float8 linears, context and expert parallelism) would
// silently do nothing, so it refuses those children when it is applied. The qualified names
// (relative to `root`) of the modules under `root` whose caller is a Sequential, in module
// order; `root` itself is never one (its caller is unknown).
std::vector<std::string> sequential_children(const torch::nn::Module& root);

} // namespace dtensor::detail
