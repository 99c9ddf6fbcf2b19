// DTensor factories (dtensor/factories.h): the local shard only, no communication.
#include <dtensor/factories.h>

#include <ATen/ATen.h>

#include "internal/check.h"
#include "tensor/dtensor_impl.h"
#include "tensor/random/rng_state.h"
#include "tensor/random/sample.h"

namespace dtensor {

namespace {

enum class Init { kZeros, kOnes, kEmpty, kFull, kRand, kRandn };

const char* name_of(Init init) {
  static const char* names[] = {"zeros", "ones", "empty", "full", "rand", "randn"};
  return names[static_cast<int>(init)];
}

// Which Partial placements keep the filled value: zeros and empty any; a constant a
// reduction that takes one of equal values (avg, max, min), never a sum (it would multiply
// the value by the group size); random values none (their pieces are not summands).
void check_partials(Init init, const Placements& placements) {
  for (const auto& p : placements) {
    if (!p.is_partial() || init == Init::kZeros || init == Init::kEmpty) {
      continue;
    }
    const bool constant_ok = (init == Init::kOnes || init == Init::kFull) && !p.is_norm_partial() &&
                             p.reduce_op() != ReduceOp::Sum;
    DTENSOR_CHECK(constant_ok,
                  "dtensor::{}: placement {} in {}: the reduced value would differ from the "
                  "filled one; use Replicate",
                  name_of(init), p.to_string(), to_string(placements));
  }
}

DTensor make(Init init, at::IntArrayRef size, const at::Scalar* fill_value, const DeviceMesh& mesh,
             const Placements& given, const at::TensorOptions& options) {
  const char* what = name_of(init);
  for (int64_t s : size) {
    DTENSOR_CHECK(s >= 0, "dtensor::{}: negative dimension in size {}", what, size.vec());
  }
  DTENSOR_CHECK(!options.has_device() || options.device().type() == mesh.device_type(),
                "dtensor::{}: device {} is not of the mesh's type: {}", what,
                options.device().str(), mesh.to_string());
  DTENSOR_CHECK(options.layout() == at::kStrided, "dtensor::{}: only the strided layout is supported",
                what);
  const Placements placements =
      given.empty() ? Placements(static_cast<size_t>(mesh.ndim()), Placement::replicate()) : given;
  DTENSOR_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(),
                "dtensor::{}: {} placements {} for a {}-D mesh {}", what, placements.size(),
                to_string(placements), mesh.ndim(), mesh.to_string());
  check_partials(init, placements);
  const at::ScalarType dtype =
      options.has_dtype() ? options.dtype().toScalarType() : at::get_default_dtype_as_scalartype();
  DTensorSpec spec = detail::make_spec(mesh, placements, size.vec(), dtype);
  at::TensorOptions local_options =
      at::TensorOptions().dtype(dtype).device(options.has_device() ? options.device()
                                                                     : c10::Device(mesh.device_type()));
  const std::vector<int64_t> local_shape = spec.local_shape();
  at::Tensor local;
  switch (init) {
  case Init::kZeros: local = at::zeros(local_shape, local_options); break;
  case Init::kOnes: local = at::ones(local_shape, local_options); break;
  case Init::kEmpty: local = at::empty(local_shape, local_options); break;
  case Init::kFull: local = at::full(local_shape, *fill_value, local_options); break;
  case Init::kRand:
  case Init::kRandn: {
    DTENSOR_CHECK(at::isFloatingType(dtype), "dtensor::{}: expects a floating dtype, got {}", what,
                  c10::toString(dtype));
    local = at::empty(local_shape, local_options);
    detail::Distribution d{init == Init::kRand ? detail::Distribution::kUniform
                                               : detail::Distribution::kNormal,
                           0.0, 1.0};
    detail::fill_box(local, detail::Box{spec.shape, spec.local_offset()},
                     detail::next_draw(std::nullopt, what), d);
    break;
  }
  }
  DTensor out(detail::make_dtensor(local, std::move(spec)));
  if (options.requires_grad()) {
    out.set_requires_grad(true);
  }
  return out;
}

} // namespace

DTensor zeros(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements,
              const at::TensorOptions& options) {
  return make(Init::kZeros, size, nullptr, mesh, placements, options);
}
DTensor ones(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements,
             const at::TensorOptions& options) {
  return make(Init::kOnes, size, nullptr, mesh, placements, options);
}
DTensor empty(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements,
              const at::TensorOptions& options) {
  return make(Init::kEmpty, size, nullptr, mesh, placements, options);
}
DTensor full(at::IntArrayRef size, const at::Scalar& fill_value, const DeviceMesh& mesh,
             const Placements& placements, const at::TensorOptions& options) {
  return make(Init::kFull, size, &fill_value, mesh, placements, options);
}
DTensor rand(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements,
             const at::TensorOptions& options) {
  return make(Init::kRand, size, nullptr, mesh, placements, options);
}
DTensor randn(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements,
              const at::TensorOptions& options) {
  return make(Init::kRandn, size, nullptr, mesh, placements, options);
}

} // namespace dtensor
