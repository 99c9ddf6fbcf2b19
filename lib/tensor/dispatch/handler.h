#pragma once

// The DTensor dispatch handler (dispatch.cpp) and the kernels registered beside it on
// PrivateUse1 (registration.cpp).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace dtensor::detail {

// [Note: the handler's steps] in dispatch.cpp: one boxed kernel for every op on DTensors.
void handler(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// [Note: shape inference on meta] The handler learns an op's global output shapes by running
// it on meta tensors of the global shapes (infer_output_shapes in dispatch.cpp). No rank
// computes or holds those: planning (lib/sim) leaves them out of a rank's FLOPs and memory.
bool in_shape_inference();

} // namespace dtensor::detail
