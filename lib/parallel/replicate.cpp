// replicate(): data-parallel gradients by bucketed all-reduce from post-accumulate-grad
// hooks (DDP semantics).
#include <dtensor/replicate.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "mesh/dispatch_keys.h"
#include "mesh/rank_device.h"
#include "parallel/end_of_backward.h"
#include "parallel/grad_reduce.h"

namespace dtensor {

namespace detail {

struct Bucket {
  std::vector<at::Tensor> params;
  size_t ready = 0;
  bool reduced = false;
};

struct ReplicateState : std::enable_shared_from_this<ReplicateState> {
  DeviceMesh mesh;
  Group group;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<std::pair<CommHookState, CommHook>> comm_hook;
  std::vector<Bucket> buckets;
  std::unordered_map<const c10::TensorImpl*, size_t> bucket_of;
  bool sync = true;
  EndOfBackward end_of_backward; // [Note: failed backward] in lib/parallel/end_of_backward.cpp
  std::mutex mutex;

  void on_grad_ready(const at::Tensor& param);
  void reduce(Bucket& bucket);
  void reduce_flat(at::Tensor& flat);
  void finish_backward();
};

void ReplicateState::reduce(Bucket& bucket) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (auto& p : bucket.params) {
    if (!p.grad().defined()) {
      p.mutable_grad() = at::zeros_like(p); // unused in this backward
    }
    grads.push_back(p.grad().reshape({-1}));
  }
  at::Tensor flat = at::cat(grads);
  reduce_flat(flat);
  int64_t offset = 0;
  for (auto& p : bucket.params) {
    int64_t n = p.numel();
    p.mutable_grad().copy_(flat.narrow(0, offset, n).view_as(p));
    offset += n;
  }
  bucket.reduced = true;
}

void ReplicateState::reduce_flat(at::Tensor& flat) {
  const int64_t numel = flat.numel();
  if (comm_hook) {
    const auto& [registered, hook] = *comm_hook;
    hook.all_reduce(resolved_hook_state(registered, group), flat);
    DTENSOR_CHECK(flat.defined() && flat.numel() == numel,
                  "replicate: communication hook '{}' must leave a bucket of {} elements, got {}",
                  hook.name, numel, flat.defined() ? flat.numel() : 0);
    return;
  }
  if (reduce_dtype) {
    flat = flat.to(*reduce_dtype);
  }
  const DivideFactors f = gradient_divide_factors(group.size(), flat.scalar_type(), 0, false);
  if (f.pre != 1) {
    flat.div_(f.pre);
  }
  dtensor::all_reduce_(flat, f.all_reduce_op, group, detail::known_sizes());
  if (f.post != 1) {
    flat.div_(f.post);
  }
}

void ReplicateState::finish_backward() {
  std::lock_guard<std::mutex> lock(mutex);
  // Every bucket is reduced each backward, on every rank, even when none of its parameters
  // was used here: another rank may have used them, and collectives must match.
  for (auto& b : buckets) {
    if (!b.reduced) {
      reduce(b);
    }
  }
  for (auto& b : buckets) {
    b.ready = 0;
    b.reduced = false;
  }
  end_of_backward.ran();
}

void ReplicateState::on_grad_ready(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!sync) {
    return;
  }
  // Buckets left incomplete (unused parameters) are finished when the backward ends; after
  // a backward that failed, its bucket counts go first.
  std::weak_ptr<ReplicateState> weak = shared_from_this();
  end_of_backward.queue(
      [this] {
        for (auto& b : buckets) {
          b.ready = 0;
          b.reduced = false;
        }
      },
      [weak] {
        if (auto s = weak.lock()) {
          s->finish_backward();
        }
      });
  auto it = bucket_of.find(param.unsafeGetTensorImpl());
  if (it == bucket_of.end()) {
    return;
  }
  Bucket& b = buckets[it->second];
  if (++b.ready == b.params.size()) {
    reduce(b);
  }
}

namespace {

struct GradReadyHook : torch::autograd::PostAccumulateGradHook {
  explicit GradReadyHook(std::weak_ptr<ReplicateState> s) : state(std::move(s)) {}
  void operator()(const torch::autograd::Variable& tensor) override {
    if (auto s = state.lock()) {
      s->on_grad_ready(tensor);
    }
  }
  std::weak_ptr<ReplicateState> state;
};

std::mutex registry_mutex;
std::unordered_map<const torch::nn::Module*, std::weak_ptr<ReplicateState>>& registry() {
  static std::unordered_map<const torch::nn::Module*, std::weak_ptr<ReplicateState>> r;
  return r;
}

bool holds_all(const std::vector<int>& have, const std::vector<int>& want) {
  return std::all_of(want.begin(), want.end(), [&](int r) {
    return std::find(have.begin(), have.end(), r) != have.end();
  });
}

} // namespace

bool gradient_reduced_over(const at::Tensor& param, const std::vector<int>& ranks) {
  if (is_dtensor(param)) {
    return holds_all(DTensor(param).device_mesh().ranks(), ranks);
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (const auto& [module, weak] : registry()) {
    const auto state = weak.lock();
    if (state && state->bucket_of.count(param.unsafeGetTensorImpl()) != 0 &&
        holds_all(state->mesh.ranks(), ranks)) {
      return true;
    }
  }
  return false;
}

} // namespace detail

struct ReplicateHandle::State : detail::ReplicateState {};

ReplicateHandle::ReplicateHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}

void ReplicateHandle::set_requires_gradient_sync(bool sync) {
  DTENSOR_CHECK(state_ != nullptr, "ReplicateHandle: empty handle");
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->sync = sync;
}

int64_t ReplicateHandle::num_buckets() const {
  DTENSOR_CHECK(state_ != nullptr, "ReplicateHandle: empty handle");
  return static_cast<int64_t>(state_->buckets.size());
}

void ReplicateHandle::register_comm_hook(CommHookState state, CommHook hook) {
  DTENSOR_CHECK(state_ != nullptr, "ReplicateHandle: empty handle");
  DTENSOR_CHECK(static_cast<bool>(hook.all_reduce),
                "replicate register_comm_hook: hook '{}' has no all_reduce, which replicate calls",
                hook.name);
  std::lock_guard<std::mutex> lock(state_->mutex);
  DTENSOR_CHECK(!state_->comm_hook,
                "A communication hook is already registered (replicate on {} has '{}')",
                state_->mesh.to_string(), state_->comm_hook ? state_->comm_hook->second.name : "");
  state_->comm_hook.emplace(std::move(state), std::move(hook));
}

bool ReplicateHandle::has_comm_hook() const {
  DTENSOR_CHECK(state_ != nullptr, "ReplicateHandle: empty handle");
  return state_->comm_hook.has_value();
}

const DeviceMesh& ReplicateHandle::mesh() const {
  DTENSOR_CHECK(state_ != nullptr, "ReplicateHandle: empty handle");
  return state_->mesh;
}

std::optional<ReplicateHandle> replicate_handle(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(detail::registry_mutex);
  auto it = detail::registry().find(&module);
  if (it == detail::registry().end()) {
    return std::nullopt;
  }
  auto state = it->second.lock();
  if (!state) {
    return std::nullopt;
  }
  return ReplicateHandle(std::static_pointer_cast<ReplicateHandle::State>(state));
}

ReplicateHandle replicate(torch::nn::Module& module, const DeviceMesh& mesh,
                          const ReplicateOptions& options) {
  DTENSOR_CHECK(mesh.defined() && mesh.ndim() == 1, "replicate({}): needs a 1-D mesh, got {}",
                module.name(), mesh.to_string());
  DTENSOR_CHECK(options.bucket_cap_mb() > 0, "replicate({}): bucket_cap_mb {} must be positive",
                module.name(), options.bucket_cap_mb());
  {
    std::lock_guard<std::mutex> lock(detail::registry_mutex);
    auto it = detail::registry().find(&module);
    DTENSOR_CHECK(it == detail::registry().end() || it->second.expired(),
                  "replicate({}): this module is already replicated", module.name());
  }
  auto state = std::make_shared<ReplicateHandle::State>();
  state->mesh = mesh;
  state->group = mesh.get_group();
  state->reduce_dtype = options.reduce_dtype();
  auto params = module.parameters();
  for (const auto& p : params) {
    DTENSOR_CHECK(
        !p.unsafeGetTensorImpl()->key_set().has_backend(detail::kDTensorBackend),
        "replicate({}): parameter of shape {} is a DTensor; replicate takes plain parameters",
        module.name(), p.sizes());
  }
  { // [Note: tensors follow the mesh's device] (lib/mesh/rank_device.h), as fully_shard
    torch::NoGradGuard no_grad;
    const std::string what = "replicate(" + module.name() + ")";
    for (const auto& list : {module.parameters(), module.buffers()}) {
      for (at::Tensor t : list) {
        at::Tensor moved =
            detail::to_rank_device(t.detach(), mesh.device_type(), what, mesh.to_string());
        if (moved.device() != t.device()) {
          t.set_data(moved);
        }
      }
    }
  }
  if (options.broadcast_from_rank0()) {
    // Meta tensors have nothing to send: after to_empty, a layout-independent init gives
    // every rank the same values ([Note: layout-independent random numbers]).
    torch::NoGradGuard no_grad;
    for (auto p : params) {
      if (!p.is_meta()) {
        at::Tensor data = p.detach();
        broadcast_(data, 0, state->group);
      }
    }
    for (auto b : module.buffers()) {
      if (b.defined() && !b.is_meta()) {
        at::Tensor data = b.detach();
        broadcast_(data, 0, state->group);
      }
    }
  }
  // Buckets in reverse parameter order (gradients tend to be ready last layer first), one
  // dtype per bucket, at most bucket_cap_mb each.
  const auto cap = static_cast<int64_t>(options.bucket_cap_mb() * 1024 * 1024);
  int64_t bytes = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const at::Tensor& p = *it;
    if (!p.requires_grad()) {
      continue;
    }
    int64_t n = static_cast<int64_t>(p.nbytes());
    bool new_bucket = state->buckets.empty() || bytes + n > cap ||
                      state->buckets.back().params.front().scalar_type() != p.scalar_type();
    if (new_bucket) {
      state->buckets.emplace_back();
      bytes = 0;
    }
    state->buckets.back().params.push_back(p);
    state->bucket_of[p.unsafeGetTensorImpl()] = state->buckets.size() - 1;
    bytes += n;
  }
  for (const auto& b : state->buckets) {
    for (const auto& p : b.params) {
      torch::autograd::impl::set_post_acc_grad_hooks(
          p, std::make_unique<detail::GradReadyHook>(std::weak_ptr<detail::ReplicateState>(state)));
    }
  }
  {
    std::lock_guard<std::mutex> lock(detail::registry_mutex);
    detail::registry()[&module] = state;
  }
  return ReplicateHandle(state);
}

} // namespace dtensor
