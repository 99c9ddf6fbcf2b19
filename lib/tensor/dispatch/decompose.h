#pragma once

// [Note: the decomposition fallback] An op without a sharding rule whose DTensor arguments
// are not all Replicate runs its composite kernel when it has one: the
// CompositeExplicitAutograd(NonFunctional) kernel is a C++ decomposition into other aten
// ops (view_copy = view + clone, diag_embed, select_scatter, rot90, ...). Called with the
// DTensors themselves, each piece reaches the handler again and meets its own rule (and its
// own collectives). PyTorch's DTensor does the same from its Python decomposition table;
// LibTorch has no such table, so only ops whose composite kernel is the one the backend
// runs qualify (an op with its own CPU / CUDA kernel would run that kernel on the
// DTensor), and only functional ones: views and in-place / out= ops decompose into
// as_strided and metadata updates that a DTensor's global strides do not describe. An op
// that qualifies for neither keeps its error naming it. The _foreach_ ops decompose element
// by element ([Note: _foreach_ ops, element by element], decompose.cpp).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace dtensor::detail {

// Whether `op` runs its composite kernel on backend `device` (no kernel of its own there).
bool has_decomposition(const c10::OperatorHandle& op, c10::DeviceType device);

// Runs `op` on the stack's arguments (DTensors included) through its composite kernel; an
// error from a piece names `op` first.
void run_decomposition(const c10::OperatorHandle& op, c10::DeviceType device,
                       torch::jit::Stack* stack);

} // namespace dtensor::detail
