// get_model_state_dict / set_model_state_dict for modules with DTensor parameters.
#include <dtensor/state_dict.h>

#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>
#include <dtensor/fully_shard.h>

#include "internal/check.h"
#include "mesh/agree.h"
#include "tensor/dtensor_impl.h"
#include "tensor/placement_helpers.h"
#include "tensor/redistribute/redistribute.h"

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

namespace {

std::string shape_str(at::IntArrayRef s) {
  return fmt::format("{}", s);
}

// What is wrong with `state` as a state dict for `targets` ("" when nothing), found before
// any value is touched. `where` says whose dict it is (" on rank 0" for broadcast loads).
std::string validate(const std::vector<std::pair<std::string, at::Tensor>>& targets,
                     const StateDict& state, const std::string& module_name, bool full_only,
                     const std::string& where) {
  std::unordered_set<std::string> known;
  for (const auto& e : targets) {
    known.insert(e.first);
  }
  for (const auto& item : state) {
    if (known.count(item.key()) == 0) {
      return fmt::format("'{}'{} is not a parameter or buffer of module '{}'", item.key(), where,
                         module_name);
    }
  }
  for (const auto& [name, t] : targets) {
    const at::Tensor* found = state.find(name);
    if (found == nullptr) {
      return fmt::format("'{}' is missing{}", name, where.empty() ? " from the state dict" : where);
    }
    if (!found->defined()) {
      return fmt::format("'{}'{} is an undefined tensor", name, where);
    }
    const detail::DTensorMeta* vm = detail::dtensor_meta(*found);
    const detail::DTensorMeta* tm = detail::dtensor_meta(t);
    if (vm != nullptr && full_only) {
      return fmt::format("'{}'{} is a DTensor; broadcast_from_rank0 loads full tensors", name,
                         where);
    }
    if (found->sizes() != t.sizes()) {
      return fmt::format("'{}' has shape {}{} but the module's is {}", name,
                         shape_str(found->sizes()), where, shape_str(t.sizes()));
    }
    if (vm != nullptr && tm == nullptr) {
      return fmt::format("'{}'{} is a DTensor but the module's tensor is plain", name, where);
    }
    if (vm != nullptr && !(vm->spec.mesh == tm->spec.mesh)) {
      return fmt::format("'{}'{} lives on {} but the parameter on {}", name, where,
                         vm->spec.mesh.to_string(), tm->spec.mesh.to_string());
    }
  }
  return "";
}

} // namespace

// [Note: loading state dicts safely]
// Every rank validates what it was given (names, shapes, meshes) before any value moves or
// is written, and, when collectives follow (broadcast_from_rank0, or DTensor parameters),
// the ranks agree on the outcome (agree_on_errors: one small all-gather over the world),
// so a bad dict on one rank fails every rank with the same error instead of leaving the
// others in a broadcast, and the module is left untouched. With broadcast_from_rank0 only
// rank 0's dict is validated (the others may pass anything, as in PyTorch).
void set_model_state_dict(torch::nn::Module& module, const StateDict& state,
                          const StateDictOptions& options) {
  at::NoGradGuard no_grad;
  auto targets = entries(module);
  const bool from_rank0 = options.broadcast_from_rank0();
  std::string error;
  if (!from_rank0) {
    error = validate(targets, state, module.name(), false, "");
  } else if (get_rank() == 0) {
    error = validate(targets, state, module.name(), true, " on rank 0");
  }
  // Agreement is needed only where collectives follow: the broadcasts, or redistributing
  // DTensor values. A plain module loads without communication, so its error stays local.
  bool collective = from_rank0;
  for (const auto& e : targets) {
    collective = collective || detail::dtensor_meta(e.second) != nullptr;
  }
  if (collective) {
    detail::agree_on_errors("set_model_state_dict", error, world_group());
  } else {
    DTENSOR_CHECK(error.empty(), "set_model_state_dict: {}", error);
  }
  for (auto& [name, t] : targets) {
    const at::Tensor* found = state.find(name);
    at::Tensor value;
    const detail::DTensorMeta* m = detail::dtensor_meta(t);
    if (from_rank0) {
      // Rank 0's value, or a buffer of the right shape elsewhere, broadcast over the world,
      // on the world's device: a CPU module in an NCCL world goes through the GPU (as
      // PyTorch's broadcast of a full state dict), then into the module below.
      const c10::Device via =
          world_group().device_type() == t.device().type() ? t.device() : default_device();
      if (get_rank() == 0) {
        value = found->detach().to(via, t.scalar_type()).contiguous();
      } else {
        value = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).device(via));
      }
      broadcast_(value, 0, world_group());
    } else {
      value = *found;
    }
    if (m == nullptr) {
      t.detach().copy_(value);
      continue;
    }
    at::Tensor local;
    if (const detail::DTensorMeta* vm = detail::dtensor_meta(value)) {
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
