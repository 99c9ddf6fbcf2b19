// FSDPModule: the controls of a fully_shard unit (dtensor/fully_shard.h), on its param
// group and its state (lib/parallel/fsdp/fsdp_state.h).
#include <dtensor/fully_shard.h>

#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>


#include "internal/check.h"
#include "parallel/fsdp/fsdp_state.h"
#include "tensor/dispatch/op_args.h" // in_backward

namespace dtensor {

FSDPModule::FSDPModule(std::shared_ptr<Unit> unit) : unit_(std::move(unit)) {}

namespace {

detail::FSDPParamGroup& group_of(const std::shared_ptr<FSDPModule::Unit>& unit) {
  return static_cast<detail::FSDPParamGroup&>(*unit);
}

// The unit and, with recurse, every unit inside its module.
std::vector<detail::FSDPParamGroup*> units_under(detail::FSDPParamGroup& group, bool recurse) {
  std::vector<detail::FSDPParamGroup*> out{&group};
  if (recurse) {
    for (auto& s : detail::live_units()) {
      if (group.fsdp_state().is_ancestor_of(*s)) {
        out.push_back(&s->group);
      }
    }
  }
  return out;
}

} // namespace

UnshardHandle::UnshardHandle(FSDPModule unit) : unit_(std::move(unit)) {}

void UnshardHandle::wait() {
  if (unit_.defined()) {
    group_of(unit_.unit_).finish_unshard();
  }
}

UnshardHandle FSDPModule::unshard(bool async_op) {
  group_of(unit_).unshard(async_op, /*background=*/async_op);
  return UnshardHandle(*this);
}
void FSDPModule::reshard() {
  group_of(unit_).reshard();
}

void FSDPModule::set_requires_gradient_sync(bool sync, bool recurse) {
  for (auto& g : units_under(group_of(unit_), recurse)) {
    g->requires_gradient_sync = sync;
    g->requires_all_reduce = sync;
  }
}

void FSDPModule::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  for (auto& g : units_under(group_of(unit_), recurse)) {
    g->requires_all_reduce = requires_all_reduce;
  }
}

void FSDPModule::set_is_last_backward(bool is_last_backward) {
  group_of(unit_).fsdp_state().context().is_last_backward = is_last_backward;
}

void FSDPModule::set_post_optim_event(c10::Event event) {
  const detail::FSDPParamGroup& root = group_of(unit_).fsdp_state().root().group;
  DTENSOR_CHECK(event.device_type() == root.mesh.device_type(),
                "set_post_optim_event: the event is a {} event but unit '{}' runs on a {} mesh",
                c10::DeviceTypeName(event.device_type(), /*lower_case=*/true), root.name,
                c10::DeviceTypeName(root.mesh.device_type(), /*lower_case=*/true));
  group_of(unit_).fsdp_state().context().post_optim_event =
      std::make_shared<c10::Event>(std::move(event));
}

bool FSDPModule::has_post_optim_event() const {
  return group_of(unit_).fsdp_state().context().post_optim_event != nullptr;
}

void FSDPModule::set_unshard_in_backward(bool unshard_in_backward) {
  group_of(unit_).unshard_in_backward = unshard_in_backward;
}

void FSDPModule::set_reshard_after_forward(bool reshard, bool recurse) {
  for (auto& g : units_under(group_of(unit_), recurse)) {
    g->reshard_after_forward = reshard;
    g->post_forward_size = 0; // a bool replaces an int given to fully_shard
  }
}

void FSDPModule::set_reshard_after_backward(bool reshard, bool recurse) {
  for (auto& g : units_under(group_of(unit_), recurse)) {
    g->reshard_after_backward = reshard;
  }
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  auto& prefetch = group_of(unit_).fsdp_state().forward_prefetch;
  prefetch.clear();
  for (const auto& m : modules) {
    DTENSOR_CHECK(m.defined(),
                  "set_modules_to_forward_prefetch: an undefined FSDPModule in the list");
    prefetch.push_back(group_of(m.unit_).fsdp_state().weak_from_this());
  }
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  auto& prefetch = group_of(unit_).fsdp_state().backward_prefetch;
  prefetch.clear();
  for (const auto& m : modules) {
    DTENSOR_CHECK(m.defined(),
                  "set_modules_to_backward_prefetch: an undefined FSDPModule in the list");
    prefetch.push_back(group_of(m.unit_).fsdp_state().weak_from_this());
  }
}

void FSDPModule::set_communication_overlap(bool enable, bool recurse) {
  for (auto& g : units_under(group_of(unit_), recurse)) {
    g->overlap = enable;
  }
}

void FSDPModule::set_gradient_divide_factor(double factor) {
  DTENSOR_CHECK(factor > 0, "set_gradient_divide_factor: factor must be positive, got {}", factor);
  group_of(unit_).gradient_divide_factor = factor;
}

void FSDPModule::set_all_reduce_hook(std::function<void(at::Tensor&)> hook) {
  group_of(unit_).all_reduce_hook = std::move(hook);
}

void FSDPModule::set_force_sum_reduction_for_comms(bool enable) {
  group_of(unit_).force_sum_reduction = enable;
}

void FSDPModule::set_custom_all_gather(CustomAllGather comm) {
  group_of(unit_).custom_all_gather = std::move(comm);
}

void FSDPModule::set_custom_reduce_scatter(CustomReduceScatter comm) {
  group_of(unit_).custom_reduce_scatter = std::move(comm);
}

void FSDPModule::register_comm_hook(CommHookState state, CommHook hook) {
  const auto& root = group_of(unit_);
  const auto parent = root.fsdp_state().parent.lock();
  DTENSOR_CHECK(parent == nullptr,
                "register_comm_hook can only be called on a root instance: unit '{}' is nested "
                "in unit '{}'",
                root.name, parent ? parent->name() : "");
  DTENSOR_CHECK(static_cast<bool>(hook.reduce_scatter),
                "register_comm_hook on unit '{}': hook '{}' has no reduce_scatter, which "
                "fully_shard units call",
                root.name, hook.name);
  const auto units = units_under(group_of(unit_), /*recurse=*/true);
  for (const auto& g : units) {
    DTENSOR_CHECK(!g->replicate_group || static_cast<bool>(hook.all_reduce),
                  "register_comm_hook on unit '{}': hook '{}' has no all_reduce, which HSDP unit "
                  "'{}' (on {}) needs for its replicate dim ([Note: communication hooks on HSDP])",
                  root.name, hook.name, g->name, g->mesh.to_string());
    DTENSOR_CHECK(!g->comm_hook, "A communication hook is already registered (unit '{}' has '{}')",
                  g->name, g->comm_hook ? g->comm_hook->second.name : "");
  }
  for (const auto& g : units) {
    g->comm_hook.emplace(state, hook);
  }
}

bool FSDPModule::has_comm_hook() const {
  return group_of(unit_).comm_hook.has_value();
}

std::string FSDPModule::name() const {
  return group_of(unit_).name;
}

std::vector<at::Tensor> FSDPModule::parameters() const {
  std::vector<at::Tensor> params;
  std::unordered_set<const c10::TensorImpl*> seen; // a grouped unit's modules may share some
  for (const auto& weak : group_of(unit_).fsdp_state().modules) {
    auto module = weak.lock();
    DTENSOR_CHECK(module != nullptr,
                  "FSDPModule::parameters: a module of unit '{}' no longer exists",
                  group_of(unit_).name);
    for (const auto& p : module->parameters()) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) {
        params.push_back(p);
      }
    }
  }
  return params;
}

// [Note: finalize_backward] Each backward already ends with its root's end-of-backward
// callback (fsdp_state.cpp), which reduces what sync-on units received; with sync off it only
// keeps the unsharded gradients. So unlike FSDP2 there is no manual-finalization mode to enter:
// finalize_backward reduces what backwards with sync off left behind, in the units' creation
// order (the same on every rank of the data-parallel group), and needs no callback.
GradientReductionHandle FSDPModule::finalize_backward(bool async_op) {
  detail::FSDPState& root = group_of(unit_).fsdp_state();
  DTENSOR_CHECK(root.is_root(),
                "finalize_backward: unit '{}' is nested in unit '{}'; call it on the root unit",
                root.name(), root.root().name());
  DTENSOR_CHECK(!detail::in_backward(),
                "finalize_backward: unit '{}': called during a backward; call it after the "
                "backward has returned",
                root.name());
  const auto units = detail::units_of_root(root);
  for (const auto& s : units) {
    if (s->group.requires_gradient_sync && s->group.has_pending_grads()) {
      s->group.reduce_grads();
    }
  }
  if (!async_op) {
    root.context().finish_reduces();
  }
  for (const auto& s : units) {
    if (s->group.reshard_after_backward) {
      s->group.reshard(); // the gradients were copied into the reduce-scatter's buffer
    }
  }
  return GradientReductionHandle(*this);
}

GradientReductionHandle::GradientReductionHandle(FSDPModule root) : root_(std::move(root)) {}

void GradientReductionHandle::wait() {
  if (root_.defined()) {
    group_of(root_.unit_).fsdp_state().context().finish_reduces();
  }
}

const DeviceMesh& FSDPModule::mesh() const {
  return group_of(unit_).mesh;
}
bool FSDPModule::is_root() const {
  return group_of(unit_).fsdp_state().is_root();
}
bool FSDPModule::is_unsharded() const {
  group_of(unit_).finish_unshard();
  return group_of(unit_).state == detail::ShardState::Unsharded;
}
int64_t FSDPModule::unsharded_storage_bytes() const {
  return group_of(unit_).unsharded_storage_bytes();
}

std::vector<at::Tensor> FSDPModule::managed_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : group_of(unit_).params) {
    out.push_back(p.param);
  }
  return out;
}

} // namespace dtensor
