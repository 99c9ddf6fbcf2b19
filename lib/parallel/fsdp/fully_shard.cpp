// fully_shard(): choosing a unit's parameters, the unit tree, and the FSDPModule controls.
#include <dtensor/fully_shard.h>

#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/nn/module.h>

#include <dtensor/dtensor.h>
#include <dtensor/module_hooks.h>
#include <dtensor/process_group.h>

#include "internal/check.h"
#include "mesh/rank_device.h"
#include "parallel/fsdp/fsdp_state.h"
#include "parallel/module_ptr.h"
#include "parallel/tp/tensor_parallel.h"

namespace dtensor {

namespace detail {

FSDPRegistry& fsdp_registry() {
  static FSDPRegistry registry;
  return registry;
}

std::vector<std::shared_ptr<FSDPState>> live_units() {
  FSDPRegistry& reg = fsdp_registry();
  std::vector<std::shared_ptr<FSDPState>> out;
  auto& units = reg.units;
  units.erase(
      std::remove_if(units.begin(), units.end(), [](const auto& u) { return u.first.expired(); }),
      units.end());
  std::unordered_set<const FSDPState*> seen; // a grouped unit has an entry per module
  for (auto& u : units) {
    if (seen.insert(u.second.get()).second) {
      out.push_back(u.second);
    }
  }
  return out;
}

std::vector<std::shared_ptr<FSDPState>> units_of_root(const FSDPState& root) {
  std::vector<std::shared_ptr<FSDPState>> out;
  for (auto& s : live_units()) {
    if (&s->root() == &root) {
      out.push_back(std::move(s));
    }
  }
  return out;
}

namespace {

std::shared_ptr<FSDPState> find_unit(const torch::nn::Module* module) {
  for (auto& u : fsdp_registry().units) {
    if (auto m = u.first.lock(); m && m.get() == module) {
      return u.second;
    }
  }
  return nullptr;
}

bool is_prefix_of(const std::string& prefix, const std::string& name) {
  return prefix.empty() || name == prefix || name.rfind(prefix + ".", 0) == 0;
}

} // namespace

} // namespace detail

namespace {

using NamedModules = torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>;

// The data-parallel mesh: the option's, or 1-D over the world.
DeviceMesh resolve_mesh(const FullyShardOptions& options) {
  DeviceMesh mesh = options.mesh();
  if (!mesh.defined()) {
    const auto device =
        get_backend() == BackendType::Nccl ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
    mesh = init_device_mesh(device, {get_world_size()});
  }
  DTENSOR_CHECK(
      mesh.ndim() == 1 || mesh.ndim() == 2,
      "fully_shard: expected a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate, shard), got {}",
      mesh.to_string());
  return mesh;
}

// The outermost submodules that are units already: they keep their parameters.
struct ChildUnits {
  std::vector<std::string> prefixes;
  std::vector<std::shared_ptr<detail::FSDPState>> units;
  bool contains(const std::string& name) const {
    for (const auto& prefix : prefixes) {
      if (detail::is_prefix_of(prefix, name)) {
        return true;
      }
    }
    return false;
  }
};

ChildUnits find_child_units(const NamedModules& named, const torch::nn::Module& module) {
  ChildUnits c;
  for (const auto& item : named) {
    if (item.value().get() == &module || c.contains(item.key())) {
      continue;
    }
    if (auto unit = detail::find_unit(item.value().get())) {
      c.prefixes.push_back(item.key());
      c.units.push_back(unit);
    }
  }
  return c;
}

// The parameters this unit takes (by name, each once, ignored ones left out), and those
// nested units hold (to refuse sharing).
struct OwnParams {
  std::vector<std::pair<std::string, at::Tensor>> own;
  std::unordered_map<const c10::TensorImpl*, std::string> in_children;
};

OwnParams collect_params(const NamedModules& named, const ChildUnits& children,
                         const FullyShardOptions& options) {
  std::unordered_set<const c10::TensorImpl*> ignored;
  for (const auto& p : options.ignored_params()) {
    ignored.insert(p.unsafeGetTensorImpl());
  }
  OwnParams out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : named) {
    const bool inside = children.contains(item.key());
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const std::string fqn = item.key().empty() ? p.key() : item.key() + "." + p.key();
      const c10::TensorImpl* impl = p.value().unsafeGetTensorImpl();
      if (inside) {
        out.in_children.emplace(impl, fqn);
      } else if (!ignored.count(impl) && seen.insert(impl).second) {
        out.own.emplace_back(fqn, p.value());
      }
    }
  }
  return out;
}

void check_params(const std::string& unit_name, const OwnParams& params, const DeviceMesh& mesh) {
  for (const auto& [fqn, p] : params.own) {
    auto it = params.in_children.find(p.unsafeGetTensorImpl());
    DTENSOR_CHECK(
        it == params.in_children.end(),
        "fully_shard({}): parameter '{}' is shared with '{}', which a nested fully_shard unit "
        "already manages; shared parameters must belong to one unit (fully_shard their "
        "common ancestor only)",
        unit_name, fqn, it == params.in_children.end() ? "" : it->second);
    DTENSOR_CHECK(detail::fsdp_tag(p) == nullptr,
                  "fully_shard({}): parameter '{}' is already managed by another unit", unit_name,
                  fqn);
    const detail::DTensorMeta* dm = detail::dtensor_meta(p);
    // [Note: FSDP x TP] in lib/parallel/fsdp/param_group.cpp: any DTensor on a 1-D mesh beside the
    // data-parallel one (parallelize_module's, distribute_module's, hand-distributed), with
    // a 1-D (FSDP) or 2-D (HSDP) data-parallel mesh.
    DTENSOR_CHECK(dm == nullptr || dm->spec.mesh.ndim() == 1,
                  "fully_shard({}): parameter '{}' is already a DTensor ({}); fully_shard takes "
                  "plain parameters, or DTensors on a 1-D mesh (tensor parallelism) beside the "
                  "data-parallel mesh {}",
                  unit_name, fqn, dm ? dm->spec.to_string() : "", mesh.to_string());
    for (const Placement& pl : dm ? dm->spec.placements : Placements{}) {
      DTENSOR_CHECK(!pl.is_partial(),
                    "fully_shard({}): parameter '{}' is a DTensor with placement {} ({}); a "
                    "parameter can be Shard or Replicate",
                    unit_name, fqn, pl.to_string(), dm->spec.to_string());
    }
    // Plain parameters on another device move to the mesh's ([Note: tensors follow the
    // mesh's device]); a DTensor's device is its own mesh's, as FSDP2 requires.
    DTENSOR_CHECK(dm == nullptr || p.is_meta() || p.device().type() == mesh.device_type(),
                  "fully_shard({}): parameter '{}' is a DTensor on {} but the mesh {} is a {} "
                  "mesh",
                  unit_name, fqn, p.device().str(), mesh.to_string(),
                  c10::DeviceTypeName(mesh.device_type(), true));
    // Meta parameters (a module built on the meta device) stay without memory until
    // dtensor::to_empty; a unit is all meta or not at all.
    const auto& [first_fqn, first] = params.own.front();
    DTENSOR_CHECK(p.is_meta() == first.is_meta(),
                  "fully_shard({}): parameter '{}' is on {} but '{}' is on {}; a unit's "
                  "parameters are all on the meta device or none (call dtensor::to_empty on "
                  "the whole model after parallelizing it)",
                  unit_name, fqn, p.device().str(), first_fqn, first.device().str());
  }
}

// [Note: tensors follow the mesh's device] (lib/mesh/rank_device.h), as FSDP2's
// _move_states_to_device: the unit's plain parameters and its modules' buffers on another
// device type than the mesh's (a model built on the CPU for a cuda mesh) move to this rank's
// device before sharding, in place (the module keeps the same parameter objects).
void move_states_to_device(const std::string& unit_name,
                           const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                           const OwnParams& params, const DeviceMesh& mesh) {
  const std::string what = "fully_shard(" + unit_name + ")";
  auto move = [&](const at::Tensor& t) {
    at::Tensor moved =
        detail::to_rank_device(t.detach(), mesh.device_type(), what, mesh.to_string());
    if (moved.device() != t.device()) {
      at::Tensor(t).set_data(moved);
    }
  };
  torch::NoGradGuard no_grad;
  for (const auto& [fqn, p] : params.own) {
    move(p);
  }
  for (const auto& m : modules) {
    for (const auto& b : m->buffers(/*recurse=*/true)) {
      move(b);
    }
  }
}

// [Note: pinned offload] in param_group.cpp: page-locked memory comes from an
// accelerator's runtime; without one there is nothing to pin for (PyTorch fails later, in
// pin_memory(), with a message about the accelerator).
void check_offload_policy(const std::string& unit_name, const OffloadPolicy& policy) {
  if (!policy.pin_memory()) {
    return;
  }
  DTENSOR_CHECK(policy.offload_to_cpu(),
                "fully_shard({}): OffloadPolicy pin_memory(true) without offload_to_cpu(true): "
                "nothing is offloaded to pin",
                unit_name);
  DTENSOR_CHECK(at::globalContext().hasCUDA(),
                "fully_shard({}): OffloadPolicy pin_memory(true) needs a CUDA device to pin the "
                "offloaded shards for, and none is available (build with -Dcuda=enabled on a "
                "machine with a GPU, or set pin_memory(false))",
                unit_name);
}

} // namespace

namespace {

// The unit's name in messages: its module's name, or "[A, B]" for a grouped unit.
std::string unit_name(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  if (modules.size() == 1) {
    return modules.front()->name();
  }
  std::string out = "[";
  for (size_t i = 0; i < modules.size(); ++i) {
    out += (i == 0 ? "" : ", ") + modules[i]->name();
  }
  return out + "]";
}

// The parameters of all `modules` not held by nested units (each once: a parameter the
// modules share, a tied weight, is managed once), and those nested units.
std::pair<OwnParams, ChildUnits>
gather_params(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
              const FullyShardOptions& options) {
  OwnParams params;
  ChildUnits children;
  std::unordered_set<const c10::TensorImpl*> seen;
  std::unordered_set<const detail::FSDPState*> seen_units;
  for (size_t i = 0; i < modules.size(); ++i) {
    const auto named = modules[i]->named_modules();
    const ChildUnits c = find_child_units(named, *modules[i]);
    OwnParams p = collect_params(named, c, options);
    const std::string prefix = modules.size() == 1 ? "" : fmt::format("[{}].", i);
    for (auto& [fqn, t] : p.own) {
      if (seen.insert(t.unsafeGetTensorImpl()).second) {
        params.own.emplace_back(prefix + fqn, t);
      }
    }
    for (auto& [impl, fqn] : p.in_children) {
      params.in_children.emplace(impl, prefix + fqn);
    }
    for (size_t k = 0; k < c.units.size(); ++k) {
      if (seen_units.insert(c.units[k].get()).second) {
        children.units.push_back(c.units[k]);
      }
    }
  }
  return {std::move(params), std::move(children)};
}

at::Tensor fsdp_cast_floating(const at::Tensor& t, std::optional<c10::ScalarType> dtype) {
  if (!dtype || !t.defined() || !t.is_floating_point() || t.scalar_type() == *dtype) {
    return t;
  }
  return t.to(*dtype); // differentiable: the gradient comes back in t's dtype
}

// A unit's hooks on the module seam: FSDP2's casts around its forward ([Note: no input
// casting]; floating inputs to param_dtype with cast_forward_inputs, floating outputs to
// output_dtype) and its events ([Note: fully_shard on the module seam] in fsdp_state.cpp).
// A unit over several modules gets the casts only: its modules' calls are not one call.
ModuleHooks fsdp_unit_hooks(const std::shared_ptr<detail::FSDPState>& unit, bool events) {
  const MixedPrecisionPolicy& mp = unit->group.options.mp_policy();
  const std::optional<c10::ScalarType> inputs =
      mp.cast_forward_inputs() ? mp.param_dtype() : std::nullopt;
  const std::optional<c10::ScalarType> outputs = mp.output_dtype();
  std::weak_ptr<detail::FSDPState> weak = unit;
  auto event = [weak, events](void (detail::FSDPState::*fn)()) {
    if (auto s = weak.lock(); s && events) {
      ((*s).*fn)();
    }
  };
  return ModuleHooks()
      .name("fully_shard")
      .order(hook_order::kFullyShard)
      .pre_forward([inputs, event](torch::nn::Module&, TensorList& ts) {
        for (at::Tensor& t : ts) {
          t = fsdp_cast_floating(t, inputs);
        }
        event(&detail::FSDPState::pre_forward);
      })
      .post_forward([outputs, event](torch::nn::Module&, TensorList& ts) {
        event(&detail::FSDPState::post_forward);
        for (at::Tensor& t : ts) {
          t = fsdp_cast_floating(t, outputs);
        }
      })
      .pre_backward([event](torch::nn::Module&) { event(&detail::FSDPState::pre_backward); })
      .forward_failed([event](torch::nn::Module&) { event(&detail::FSDPState::forward_failed); });
}

FSDPModule shard_modules(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                         const FullyShardOptions& options) {
  using namespace detail;
  live_units(); // drops units of destroyed modules
  const std::string name = unit_name(modules);
  for (const auto& m : modules) {
    DTENSOR_CHECK(find_unit(m.get()) == nullptr,
                  "fully_shard: module '{}' is already fully sharded (call fully_shard once per "
                  "module, children before their parents)",
                  m->name());
  }
  const DeviceMesh mesh = resolve_mesh(options);
  check_offload_policy(name, options.offload_policy());
  auto [params, children] = gather_params(modules, options);
  check_params(name, params, mesh);
  move_states_to_device(name, modules, params, mesh);

  auto unit = std::make_shared<FSDPState>();
  unit->own_context = std::make_shared<FSDPStateContext>();
  unit->module = modules.front();
  for (const auto& m : modules) {
    unit->modules.push_back(m);
  }
  FSDPParamGroup& group = unit->group;
  group.name = name;
  group.mesh = mesh;
  group.options = options;
  if (!params.own.empty()) {
    group.device = params.own.front().second.device();
  }
  group.init_sharded(std::move(params.own));
  if (const auto& raf = options.reshard_after_forward()) {
    if (raf->is_group_size()) {
      group.init_post_forward(raf->group_size());
    } else {
      group.reshard_after_forward = raf->reshard();
    }
  }
  for (auto& child : children.units) {
    if (child->parent.expired()) {
      child->parent = unit;
    }
  }
  for (const auto& m : modules) {
    fsdp_registry().units.emplace_back(m, unit);
    register_module_hooks(*m, fsdp_unit_hooks(unit, /*events=*/modules.size() == 1));
  }
  return FSDPModule(group.shared());
}

} // namespace

FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options) {
  return shard_modules({detail::owned_module(module, "fully_shard")}, options);
}

FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options) {
  DTENSOR_CHECK(!modules.empty(), "fully_shard: the list of modules to group is empty");
  std::unordered_set<const torch::nn::Module*> seen;
  for (size_t i = 0; i < modules.size(); ++i) {
    DTENSOR_CHECK(modules[i] != nullptr, "fully_shard: module {} of the list is null", i);
    DTENSOR_CHECK(seen.insert(modules[i].get()).second,
                  "fully_shard: module {} of the list ('{}') is listed twice", i,
                  modules[i]->name());
  }
  return shard_modules(modules, options);
}

std::optional<FSDPModule> fsdp_module(const torch::nn::Module& module) {
  if (auto g = detail::find_unit(&module)) {
    return FSDPModule(g->group.shared());
  }
  return std::nullopt;
}

} // namespace dtensor
