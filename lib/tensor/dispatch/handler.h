#pragma once

// The DTensor dispatch handler (dispatch.cpp) and the kernels registered beside it on
// PrivateUse1 (registration.cpp).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace dtensor::detail {

// [Note: the handler's steps] in dispatch.cpp: one boxed kernel for every op on DTensors.
void handler(const c10::OperatorHandle& op, torch::jit::Stack* stack);

} // namespace dtensor::detail
