// dtensor::to_empty: memory for a model parallelized on the meta device.
#include <dtensor/materialize.h>

#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "internal/check.h"
#include "parallel/fsdp/fsdp_param_group.h"
#include "tensor/dtensor_impl.h"

namespace dtensor {

namespace {

// Allocates `t` (a parameter or buffer) on `device` if it is on the meta device. A unit
// already allocated (through an earlier parameter) is remembered in `units`.
void allocate(const at::Tensor& t, c10::Device device,
              std::unordered_set<const detail::FSDPParamGroup*>& units) {
  if (!t.defined() || !t.is_meta()) {
    return;
  }
  if (auto tag = detail::fsdp_tag(t)) {
    auto group = tag->group.lock();
    DTENSOR_CHECK(group != nullptr, "to_empty: a parameter belongs to a fully_shard unit that no "
                                    "longer exists");
    if (units.insert(group.get()).second) {
      group->to_empty(device);
    }
    return;
  }
  if (const detail::DTensorMeta* m = detail::dtensor_meta(t)) {
    at::Tensor local = at::empty(m->local.sizes(), m->local.options().device(device));
    at::Tensor dt = detail::make_dtensor(local, m->spec);
    detail::mutable_dtensor_meta(dt)->copy_extensions_from(*m);
    detail::replace_data(t, dt);
    return;
  }
  detail::replace_data(t, at::empty(t.sizes(), t.options().device(device)));
}

} // namespace

void to_empty(torch::nn::Module& module, c10::Device device) {
  DTENSOR_CHECK(!device.is_meta(), "to_empty({}): the target device must be a real device, got {}",
                module.name(), device.str());
  at::NoGradGuard no_grad;
  std::unordered_set<const detail::FSDPParamGroup*> units;
  for (const auto& p : module.parameters()) {
    allocate(p, device, units);
  }
  for (const auto& b : module.buffers()) {
    allocate(b, device, units);
  }
}

} // namespace dtensor
