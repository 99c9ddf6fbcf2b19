// [Note: the decomposition fallback] (decompose.h).
#include "tensor/dispatch/decompose.h"

#include <stdexcept>

#include "internal/check.h"

namespace dtensor::detail {

namespace {

c10::DispatchKey backend_key(c10::DeviceType device) {
  return device == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
}

} // namespace

bool has_decomposition(const c10::OperatorHandle& op, c10::DeviceType device) {
  // Views and writes decompose into as_strided and metadata updates of their argument
  // (squeeze_ -> as_strided_), which a DTensor's global strides do not describe.
  const auto& schema = op.schema();
  for (const auto& a : schema.arguments()) {
    if (a.alias_info() != nullptr) {
      return false;
    }
  }
  for (const auto& r : schema.returns()) {
    if (r.alias_info() != nullptr) {
      return false;
    }
  }
  const bool composite =
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
  return composite && !op.hasKernelForDispatchKey(backend_key(device));
}

void run_decomposition(const c10::OperatorHandle& op, c10::DeviceType device,
                       torch::jit::Stack* stack) {
  try {
    // The backend's table entry is the composite kernel (has_decomposition); the ops it
    // calls dispatch on their arguments again, DTensors included.
    op.redispatchBoxed(c10::DispatchKeySet(backend_key(device)), stack);
  } catch (const std::exception& e) {
    DTENSOR_FAIL("{} has no sharding rule and its decomposition failed: {}", op.schema().name(),
                 e.what());
  }
}

} // namespace dtensor::detail
