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
//   [[maybe_unused]] const bool registered =
//       register_interceptor({"name", 10, run, prepare, wants_extensions});
// Data of the subsystem's own rides on the DTensors as an extension ([Note: DTensor
// extensions] in lib/tensor/dtensor_impl.h).
#include <functional>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>

namespace dtensor::detail {

using OutputFinisher = std::function<void(const at::Tensor& dtensor_output)>;

// What the handler's one walk of an op's arguments found, before any interceptor runs.
struct ArgSummary {
  bool any_dtensor = false;
  bool any_extension = false; // a DTensor argument carries an extension (a subsystem's tag)
  bool any_plain = false;     // a plain tensor argument that is not 0-dim (or a list element)
};

struct OpInterceptor {
  const char* name = "";
  int order = 0; // lower first
  bool (*run)(const c10::OperatorHandle& op, torch::jit::Stack* stack) = nullptr;
  OutputFinisher (*prepare)(const c10::OperatorHandle& op, torch::jit::Stack* stack) = nullptr;
  // Whether the op can concern the interceptor at all (nullptr: always ask). [Note: the
  // handler's steps]: an op no subsystem claims costs one walk of its arguments, not one per
  // interceptor.
  bool (*wants)(const ArgSummary& summary) = nullptr;
};

// Predicates for `wants`.
inline bool wants_extensions(const ArgSummary& s) {
  return s.any_extension;
}
inline bool wants_extensions_or_plain(const ArgSummary& s) {
  return s.any_extension || s.any_plain;
}
inline bool wants_plain(const ArgSummary& s) {
  return s.any_plain;
}

bool register_interceptor(const OpInterceptor& interceptor);
const std::vector<OpInterceptor>& interceptors();

// [Note: local regions]
// dtensor::local_map runs a function on its inputs' local tensors, taken with
// DTensor::to_local. A subsystem that gives some DTensors another value for the ops of forward
// and backward (fully_shard: a managed parameter's unsharded value while its unit is
// unsharded) registers a resolver; while local_map takes its inputs local (a LocalRegion on
// this thread), to_local asks the resolvers first and takes the local tensor of what one
// returns (a DTensor, or a plain tensor taken as it is), so that the region computes on what
// every other op of the step computes on. The gradient goes to the original DTensor, with the
// resolved tensor's spec. Elsewhere to_local is the tensor's own local piece.
using LocalSourceResolver = at::Tensor (*)(const at::Tensor& dtensor);
bool register_local_source_resolver(LocalSourceResolver resolver);
// What to_local takes the local tensor of: a resolver's answer (inside a LocalRegion), else
// `dtensor` itself.
at::Tensor local_source(const at::Tensor& dtensor);
class LocalRegion {
 public:
  LocalRegion();
  ~LocalRegion();
  LocalRegion(const LocalRegion&) = delete;
  LocalRegion& operator=(const LocalRegion&) = delete;
  static bool active();
};

// Ops that see every DTensor as the DTensor it is, whatever a subsystem tagged it with:
// *_like factories (optimizer state), detach, alias.
bool keeps_parameters_as_dtensors(const c10::FunctionSchema& schema);

} // namespace dtensor::detail
