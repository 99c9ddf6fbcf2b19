// get_model_state_dict / set_model_state_dict for modules with DTensor parameters.
#include <dtensor/state_dict.h>

#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>

#include "internal/check.h"
#include "internal/fsdp.h"
#include "internal/redistribute.h"
#include "internal/sharding.h"

namespace dtensor {

namespace {

// Parameters once each (first name wins), then buffers.
std::vector<std::pair<std::string, at::Tensor>> entries(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.named_parameters()) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) {
      out.emplace_back(p.key(), p.value());
    }
  }
  for (const auto& b : module.named_buffers()) {
    if (seen.insert(b.value().unsafeGetTensorImpl()).second) {
      out.emplace_back(b.key(), b.value());
    }
  }
  return out;
}

// The unsharded copies of units whose shards were written directly are stale.
void reshard_units_of(torch::nn::Module& module) {
  for (const auto& item : module.named_modules()) {
    if (auto unit = fsdp_module(*item.value())) {
      unit->reshard();
    }
  }
}

} // namespace

StateDict get_model_state_dict(torch::nn::Module& module, const StateDictOptions& options) {
  at::NoGradGuard no_grad;
  StateDict out;
  const bool rank0_only = options.full_state_dict() && options.cpu_offload();
  for (auto& [name, t] : entries(module)) {
    at::Tensor value;
    if (const detail::DTensorMeta* m = detail::dtensor_meta(t)) {
      if (options.full_state_dict()) {
        value = detail::redistribute_local(m->local, m->spec,
                                           detail::replicate_all(m->spec.mesh.ndim()));
      } else {
        // A DTensor over the same shard (no fully_shard tag: it is plain sharded data).
        value = detail::make_dtensor(m->local, m->spec);
      }
    } else {
      value = t.detach();
    }
    if (options.cpu_offload()) {
      value = value.is_cpu() ? value : value.cpu();
    }
    if (!rank0_only || get_rank() == 0) {
      out.insert(name, value);
    }
  }
  return out;
}

void set_model_state_dict(torch::nn::Module& module, const StateDict& state,
                          const StateDictOptions& options) {
  at::NoGradGuard no_grad;
  auto targets = entries(module);
  const bool from_rank0 = options.broadcast_from_rank0();
  if (!from_rank0 || get_rank() == 0) {
    std::unordered_set<std::string> known;
    for (const auto& e : targets) {
      known.insert(e.first);
    }
    for (const auto& item : state) {
      DTENSOR_CHECK(known.count(item.key()) != 0,
                    "set_model_state_dict: '{}' is not a parameter or buffer of module '{}'",
                    item.key(), module.name());
    }
  }
  for (auto& [name, t] : targets) {
    const at::Tensor* found = state.find(name);
    at::Tensor value;
    const detail::DTensorMeta* m = detail::dtensor_meta(t);
    if (from_rank0) {
      // Rank 0's value, or a buffer of the right shape elsewhere, broadcast over the world.
      if (get_rank() == 0) {
        DTENSOR_CHECK(found != nullptr, "set_model_state_dict: '{}' is missing on rank 0", name);
        value = detail::dtensor_meta(*found) ? DTensor(*found).full_tensor() : found->detach();
        value = value.to(t.device(), t.scalar_type()).contiguous();
      } else {
        value = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).device(t.device()));
      }
      broadcast_(value, 0, world_group());
    } else {
      DTENSOR_CHECK(found != nullptr, "set_model_state_dict: '{}' is missing from the state dict",
                    name);
      value = *found;
    }
    DTENSOR_CHECK(value.sizes() == t.sizes(),
                  "set_model_state_dict: '{}' has shape {} but the module's is {}", name,
                  value.sizes(), t.sizes());
    if (m == nullptr) {
      DTENSOR_CHECK(!detail::dtensor_meta(value),
                    "set_model_state_dict: '{}' is a DTensor but the module's "
                    "tensor is plain",
                    name);
      t.detach().copy_(value);
      continue;
    }
    at::Tensor local;
    if (const detail::DTensorMeta* vm = detail::dtensor_meta(value)) {
      DTENSOR_CHECK(vm->spec.mesh == m->spec.mesh,
                    "set_model_state_dict: '{}' lives on {} but the parameter "
                    "on {}",
                    name, vm->spec.mesh.to_string(), m->spec.mesh.to_string());
      local = detail::redistribute_local(vm->local, vm->spec, m->spec.placements);
    } else {
      DTensorSpec full = m->spec;
      full.placements = detail::replicate_all(m->spec.mesh.ndim());
      local = detail::redistribute_local(value.to(m->local.device()), full, m->spec.placements);
    }
    m->local.copy_(local);
  }
  reshard_units_of(module);
}

} // namespace dtensor
