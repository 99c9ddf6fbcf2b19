#pragma once

#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <dtensor/dtensor_spec.h>

namespace dtensor::detail {

// [Note: DTensor extensions]
// Subsystems (fully_shard, tensor parallelism, and whatever plugs in later) attach their own
// data to a DTensor, one value per type T. The core stores and copies them along with the
// DTensor's metadata and never looks inside.
template <class T>
const void* extension_key() {
  static const char key = 0;
  return &key;
}

// The state of a DTensor, kept in its TensorImpl's BackendMeta so that shallow copies
// (set_data, detach, .data(), autograd's saved variables) carry it along. See
// [Note: a DTensor is an at::Tensor] in include/dtensor/dtensor.h.
struct DTensorMeta final : c10::BackendMeta {
  at::Tensor local; // plain tensor on the local device, never requires grad
  DTensorSpec spec;

  template <class T>
  std::shared_ptr<const T> extension() const {
    for (const auto& [key, value] : extensions_) {
      if (key == extension_key<T>()) {
        return std::static_pointer_cast<const T>(value);
      }
    }
    return nullptr;
  }
  void copy_extensions_from(const DTensorMeta& other) { extensions_ = other.extensions_; }
  bool has_extensions() const { return !extensions_.empty(); }
  template <class T>
  void set_extension(std::shared_ptr<const T> value) {
    for (auto& [key, slot] : extensions_) {
      if (key == extension_key<T>()) {
        slot = std::move(value);
        return;
      }
    }
    extensions_.emplace_back(extension_key<T>(), std::move(value));
  }

 private:
  std::vector<std::pair<const void*, std::shared_ptr<const void>>> extensions_;
};

// A new DTensor over `local` (which must have spec.local_shape() and spec.dtype).
at::Tensor make_dtensor(const at::Tensor& local, DTensorSpec spec);
// The same for an op's result that the caller gives up (the handler's outputs), not detached
// when nothing else holds it ([Note: results are not detached]). `check_shape` false skips
// comparing its shape with spec.local_shape(), for a decision already checked on this rank.
at::Tensor make_dtensor_from_result(at::Tensor local, DTensorSpec spec, bool check_shape);

// The state of `t`, or nullptr when `t` is not a DTensor. The mutable form is for setting
// extensions: the state belongs to the TensorImpl, which every handle to it shares.
const DTensorMeta* dtensor_meta(const at::Tensor& t);
DTensorMeta* mutable_dtensor_meta(const at::Tensor& t);
const DTensorMeta& checked_meta(const at::Tensor& t, const char* what);

// Gives `dst` (a parameter or buffer its module holds) the data of `src` in place, as
// Tensor::set_data does, also from or to the meta device, which set_data refuses
// ([Note: meta tensors change device in place] in dtensor_impl.cpp).
void replace_data(const at::Tensor& dst, const at::Tensor& src);

// The dispatch keys of a DTensor whose local tensor lives on `device`.
c10::DispatchKeySet dtensor_key_set(c10::Device device);

// A spec over `mesh` with `placements` (negative shard dims normalised, checked against
// the mesh and shape) for a tensor of global `shape` and `dtype`.
DTensorSpec make_spec(const DeviceMesh& mesh, const Placements& placements,
                      std::vector<int64_t> shape, c10::ScalarType dtype,
                      std::optional<std::vector<int64_t>> stride = std::nullopt);

} // namespace dtensor::detail
