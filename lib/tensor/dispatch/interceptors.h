#pragma once

// [Note: op interceptors]
// The DTensor dispatch handler (lib/tensor/dispatch/dispatch.cpp) knows no subsystem.
// Subsystems that give some DTensors a meaning beyond their placements (fully_shard's
// managed parameters, tensor parallelism's module layouts, ...) register an interceptor,
// and the handler asks every interceptor, in `order`, before its generic path:
//  - run: may run the op itself (return true: the stack holds the results, nothing else
//    happens). fully_shard uses it to run model math on unsharded parameters.
//  - prepare: may rewrite the arguments on the stack (redistribute, wrap plain tensors) and
//    return a function that finishes each DTensor output of the generic path (tags it).
//    Tensor parallelism uses it for module input and output layouts.
// Register from a static initializer in the subsystem's own file:
//   [[maybe_unused]] const bool registered = register_interceptor({"name", 10, run, prepare});
// Data of the subsystem's own rides on the DTensors as an extension ([Note: DTensor
// extensions] in lib/tensor/dtensor_impl.h).
#include <functional>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>

namespace dtensor::detail {

using OutputFinisher = std::function<void(const at::Tensor& dtensor_output)>;

struct OpInterceptor {
  const char* name = "";
  int order = 0; // lower first
  bool (*run)(const c10::OperatorHandle& op, torch::jit::Stack* stack) = nullptr;
  OutputFinisher (*prepare)(const c10::OperatorHandle& op, torch::jit::Stack* stack) = nullptr;
};

bool register_interceptor(const OpInterceptor& interceptor);
const std::vector<OpInterceptor>& interceptors();

// Ops that see every DTensor as the DTensor it is, whatever a subsystem tagged it with:
// *_like factories (optimizer state), detach, alias.
bool keeps_parameters_as_dtensors(const c10::FunctionSchema& schema);

} // namespace dtensor::detail
