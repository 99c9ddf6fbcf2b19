#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <dtensor/dtensor_spec.h>

namespace dtensor::detail {

struct FsdpTag; // lib/internal/fsdp.h
struct TpTag;   // lib/internal/tensor_parallel.h

// The state of a DTensor, kept in its TensorImpl's BackendMeta so that shallow copies
// (set_data, detach, .data(), autograd's saved variables) carry it along. See
// [Note: a DTensor is an at::Tensor] in include/dtensor/dtensor.h.
struct DTensorMeta : c10::BackendMeta {
  at::Tensor local; // plain tensor on the local device, never requires grad
  DTensorSpec spec;
  // Set on parameters managed by fully_shard and on views of their unsharded values.
  std::shared_ptr<FsdpTag> fsdp;
  // Set on parameters of tensor-parallel modules, views of them, and the activations their
  // ops produce.
  std::shared_ptr<const TpTag> tp;
};

// A new DTensor over `local` (which must have spec.local_shape() and spec.dtype).
at::Tensor make_dtensor(const at::Tensor& local, DTensorSpec spec);

// The state of `t`, or nullptr when `t` is not a DTensor.
const DTensorMeta* dtensor_meta(const at::Tensor& t);
const DTensorMeta& checked_meta(const at::Tensor& t, const char* what);

// The dispatch keys of a DTensor whose local tensor lives on `device`.
c10::DispatchKeySet dtensor_key_set(c10::Device device);

// A spec over `mesh` with `placements` (negative shard dims normalised, checked against
// the mesh and shape) for a tensor of global `shape` and `dtype`.
DTensorSpec make_spec(const DeviceMesh& mesh, const Placements& placements,
                      std::vector<int64_t> shape, c10::ScalarType dtype,
                      std::optional<std::vector<int64_t>> stride = std::nullopt);

} // namespace dtensor::detail
