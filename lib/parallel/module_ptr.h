#pragma once

// The shared_ptr that owns a torch::nn::Module, for APIs that keep or walk the module.
#include <memory>

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

} // namespace dtensor::detail
