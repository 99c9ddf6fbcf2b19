#pragma once

// The DTensor dispatch handler (dispatch.cpp) and the kernels registered beside it on
// PrivateUse1 (registration.cpp).

#include <cstddef>
#include <string>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace dtensor::detail {

// [Note: the handler's steps] in dispatch.cpp: one boxed kernel for every op on DTensors.
void handler(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// [Note: shape inference on meta] The handler learns an op's global output shapes by running
// it on meta tensors of the global shapes (infer_output_shapes in dispatch.cpp). No rank
// computes or holds those: planning (lib/sim) leaves them out of a rank's FLOPs and memory.
bool in_shape_inference();

// Registers the handler on PrivateUse1 for `op` ("ns::name" or with an overload) where a
// composite kernel would run on DTensors instead (a custom op given a rule).
void route_to_handler(const std::string& op);
// Ensures the op dispatcher routes DTensors to dtensor (once per process).
void ensure_dispatch_registered();

// The handler's decision cache (decision.cpp): its size and bound (dtensor::cache_sizes), and
// dropping every cached decision (a rule changed: register_sharding).
size_t decision_cache_size();
size_t decision_cache_bound();
void clear_decision_cache();

} // namespace dtensor::detail
