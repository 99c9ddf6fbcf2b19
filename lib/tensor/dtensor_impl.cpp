// Making DTensors and finding their state.
#include "tensor/dtensor_impl.h"

#include <typeinfo>

#include <ATen/ATen.h>

#include "internal/check.h"
#include "internal/torch_compat.h"
#include "mesh/dispatch_keys.h"
#include "tensor/placement_helpers.h"

namespace dtensor::detail {

c10::DispatchKeySet dtensor_key_set(c10::Device device) {
  // The backend bit of the local device next to PrivateUse1: dispatch picks PrivateUse1
  // (the higher backend), and LibTorch's set_data accepts the tensor as a dense one of
  // the same device (has_compatible_shallow_copy_type).
  c10::DispatchKey backend = device.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
  return c10::DispatchKeySet(kDTensorKey) | c10::DispatchKeySet(backend);
}

// [Note: meta tensors change device in place]
// A module's parameters are referenced by the module's members as well as by its parameter
// list, so parallelizing or materializing one must change its TensorImpl in place.
// Tensor::set_data does that only between "compatible" types: two dense tensors of real
// devices (a DTensor counts as one). A tensor on the meta device is neither, so the step from
// a meta parameter to its DTensor, or from a meta DTensor to one with real local data, would
// fail with LibTorch's "incompatible tensor type". Such steps do what set_data does without
// that check: drop the gradient accumulator (its input metadata names the old device; a new
// one is made on first use) and shallow-copy the new tensor's metadata in.
void replace_data(const at::Tensor& dst, const at::Tensor& src) {
  DTENSOR_CHECK(dst.defined() && src.defined(), "replace_data: undefined tensor");
  if (!dst.is_meta() && !src.is_meta()) {
    dst.set_data(src);
    return;
  }
  DTENSOR_CHECK(!dst.requires_grad() || at::isFloatingType(src.scalar_type()) ||
                    at::isComplexType(src.scalar_type()),
                "replace_data: a tensor that requires grad needs floating data, got {}",
                c10::toString(src.scalar_type()));
  if (dst.requires_grad()) {
    compat::set_grad_accumulator(dst, compat::NodePtr());
  }
  dst.unsafeGetTensorImpl()->shallow_copy_from(src.getIntrusivePtr());
}

DTensorSpec make_spec(const DeviceMesh& mesh, const Placements& placements,
                      std::vector<int64_t> shape, c10::ScalarType dtype,
                      std::optional<std::vector<int64_t>> stride) {
  DTENSOR_CHECK(mesh.defined(), "DTensor: undefined mesh");
  DTENSOR_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(),
                "DTensor: {} placements {} for a mesh of {} dimensions {}", placements.size(),
                to_string(placements), mesh.ndim(), mesh.to_string());
  DTensorSpec spec;
  spec.mesh = mesh;
  spec.placements = normalize_placements(placements, shape, "DTensor");
  spec.stride = stride ? *stride : contiguous_strides(shape);
  spec.shape = std::move(shape);
  spec.dtype = dtype;
  return spec;
}

namespace {

void check_local(const at::Tensor& local, const DTensorSpec& spec, bool check_shape) {
  DTENSOR_CHECK(local.defined(), "DTensor: undefined local tensor for {}", spec.to_string());
  DTENSOR_CHECK(dtensor_meta(local) == nullptr, "DTensor: the local tensor of {} is itself a DTensor",
                spec.to_string());
  if (check_shape) {
    const std::vector<int64_t> expected = spec.local_shape();
    DTENSOR_CHECK(local.sizes() == c10::IntArrayRef(expected),
                  "DTensor: local tensor of shape {} on rank {} does not match {}, whose local "
                  "shape here is {}",
                  local.sizes(), get_rank(), spec.to_string(), expected);
  }
  DTENSOR_CHECK(local.scalar_type() == spec.dtype, "DTensor: local tensor is {} but {} says {}",
                c10::toString(local.scalar_type()), spec.to_string(), c10::toString(spec.dtype));
}

// `local` must not require grad and must be the caller's to give (checked by the callers).
at::Tensor wrap_checked(at::Tensor local, DTensorSpec spec) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(dtensor_key_set(local.device()), local.dtype(),
                                                    local.device());
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(spec.shape, spec.stride);
  auto meta = c10::make_intrusive<DTensorMeta>();
  meta->local = std::move(local);
  meta->spec = std::move(spec);
  impl->set_backend_meta(meta);
  return t;
}

} // namespace

at::Tensor make_dtensor(const at::Tensor& local, DTensorSpec spec) {
  check_local(local, spec, true);
  return wrap_checked(local.detach(), std::move(spec));
}

at::Tensor make_dtensor_from_result(at::Tensor local, DTensorSpec spec, bool check_shape) {
  check_local(local, spec, check_shape);
  // [Note: results are not detached] A result the handler alone holds, outside autograd,
  // becomes the local tensor as it is: detaching would allocate a second TensorImpl for
  // nothing. One that something else also holds (an op that returns its input's local
  // tensor) is detached, so that no two DTensors share a TensorImpl.
  if (local.requires_grad() || local.use_count() != 1) {
    local = local.detach();
  }
  return wrap_checked(std::move(local), std::move(spec));
}

DTensorMeta* mutable_dtensor_meta(const at::Tensor& t) {
  if (!t.defined()) {
    return nullptr;
  }
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->key_set().has_backend(kDTensorBackend)) {
    return nullptr;
  }
  // [Note: the meta's type] Every op on a DTensor asks this for each argument: a type_info
  // comparison (DTensorMeta is final) instead of a dynamic_cast's walk of the hierarchy.
  c10::BackendMeta* meta = impl->get_backend_meta();
  return meta != nullptr && typeid(*meta) == typeid(DTensorMeta) ? static_cast<DTensorMeta*>(meta)
                                                                 : nullptr;
}

const DTensorMeta* dtensor_meta(const at::Tensor& t) {
  return mutable_dtensor_meta(t);
}

const DTensorMeta& checked_meta(const at::Tensor& t, const char* what) {
  const DTensorMeta* m = dtensor_meta(t);
  DTENSOR_CHECK(m != nullptr, "{}: expected a DTensor, got a plain tensor {}{} on {}", what,
                t.defined() ? c10::toString(t.scalar_type()) : "undefined",
                t.defined() ? t.sizes().vec() : std::vector<int64_t>{},
                t.defined() ? t.device().str() : "-");
  return *m;
}

} // namespace dtensor::detail
