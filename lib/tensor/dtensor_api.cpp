// The DTensor API: from_local, to_local, redistribute (all differentiable), full_tensor,
// distribute_tensor.
#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include "internal/check.h"
#include "mesh/agree.h"
#include "mesh/dispatch_keys.h"
#include "mesh/rank_device.h"
#include "tensor/dispatch/interceptors.h"
#include "tensor/dtensor_impl.h"
#include "tensor/placement_helpers.h"
#include "tensor/redistribute/redistribute.h"

namespace dtensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SpecHolder : torch::CustomClassHolder {
  explicit SpecHolder(DTensorSpec s) : spec(std::move(s)) {}
  DTensorSpec spec;
};

void save_spec(AutogradContext* ctx, const DTensorSpec& spec) {
  ctx->saved_data["spec"] = c10::IValue::make_capsule(c10::make_intrusive<SpecHolder>(spec));
}

const DTensorSpec& saved_spec(AutogradContext* ctx) {
  auto holder = c10::static_intrusive_pointer_cast<SpecHolder>(ctx->saved_data["spec"].toCapsule());
  return holder->spec;
}

// Gradients of a tensor that was Partial flow back as Replicate: every rank's partial
// contributed with weight one, so each rank's local gradient is the whole gradient.
Placements grad_placements(const Placements& forward) {
  Placements out;
  for (const auto& p : forward) {
    out.push_back(p.is_partial() ? Placement::replicate() : p);
  }
  return out;
}

// A DTensor gradient moved to `target` placements (no autograd recording).
at::Tensor grad_to(const at::Tensor& grad, const Placements& target) {
  const auto& m = detail::checked_meta(grad, "DTensor backward");
  if (m.spec.placements == target) {
    return grad;
  }
  at::Tensor local = detail::redistribute_local(m.local, m.spec, target);
  DTensorSpec spec = m.spec;
  spec.placements = target;
  return detail::make_dtensor(local, std::move(spec));
}

struct FromLocalFn : torch::autograd::Function<FromLocalFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local,
                            const DTensorSpec& spec) {
    save_spec(ctx, spec);
    return detail::make_dtensor(local, spec);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const DTensorSpec& spec = saved_spec(ctx);
    at::Tensor g = grads[0];
    if (!g.defined()) {
      return {at::Tensor(), at::Tensor()};
    }
    if (!detail::dtensor_meta(g)) {
      return {g, at::Tensor()}; // already local (a plain gradient of the same shape)
    }
    g = grad_to(g, grad_placements(spec.placements));
    return {detail::checked_meta(g, "from_local backward").local, at::Tensor()};
  }
};

// An alias of `t`'s storage with a version counter of its own. [Note: resolved locals] What a
// resolver gives to_local (fully_shard's unsharded value) lives in a buffer its owner frees
// and refills in place between forward and backward; autograd may save what to_local returned
// (a grouped matmul saves its weight), and a view of the buffer would share its version
// counter, which the refill bumps ("modified by an inplace operation"). The alias follows the
// storage (freed, then allocated again before backward uses it) without that check.
at::Tensor fresh_alias(const at::Tensor& t) {
  if (t.device().type() == detail::kSimulatedDevice) {
    // A simulated tensor has no values to follow: a tensor of its geometry, its own counter.
    return at::empty_strided(t.sizes(), t.strides(), t.options());
  }
  at::Tensor a = at::empty({0}, t.options());
  a.set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
  return a;
}

at::Tensor resolved_local(AutogradContext* ctx, const at::Tensor& source) {
  const detail::DTensorMeta* m = detail::dtensor_meta(source);
  if (m == nullptr) {
    ctx->saved_data["plain"] = true; // its gradient is plain too
    return fresh_alias(source);
  }
  save_spec(ctx, m->spec);
  return fresh_alias(m->local);
}

// [Note: gradient layout follows the spec] to_local's backward wraps the local gradient in the
// forward's spec, whose strides may not be contiguous (q.transpose(1, 2) taken to_local by
// context parallelism's attention). The local tensor must have the same dimension order as
// the wrapper's strides: ops decide from the wrapper whether a view is possible (reshape's
// backward of a transpose), and the local op would then fail. So the gradient is made dense
// in that order (PyTorch derives the wrapper's strides from the local gradient instead; the
// forward's layout is what the plain tensor's gradient would have).
at::Tensor dense_in_order_of(const at::Tensor& g, const std::vector<int64_t>& stride) {
  const int64_t nd = g.dim();
  if (static_cast<int64_t>(stride.size()) != nd) {
    return g.contiguous();
  }
  std::vector<int64_t> order(static_cast<size_t>(nd));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return stride[static_cast<size_t>(a)] > stride[static_cast<size_t>(b)];
  });
  std::vector<int64_t> inverse(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    inverse[static_cast<size_t>(order[k])] = static_cast<int64_t>(k);
  }
  return g.permute(order).contiguous().permute(inverse);
}

struct ToLocalFn : torch::autograd::Function<ToLocalFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& dt,
                            const std::optional<Placements>& grad_placements) {
    // [Note: local regions] in lib/tensor/dispatch/interceptors.h.
    const at::Tensor source = detail::local_source(dt);
    if (!source.is_same(dt)) {
      return resolved_local(ctx, source);
    }
    const auto& m = detail::checked_meta(source, "to_local");
    DTensorSpec spec = m.spec;
    if (grad_placements) {
      // The local gradient has the local tensor's shape: its shards must be this tensor's.
      Placements want =
          detail::normalize_placements(*grad_placements, spec.shape, "to_local(grad_placements)");
      bool same_shards = want.size() == spec.placements.size();
      for (size_t i = 0; same_shards && i < want.size(); ++i) {
        same_shards = want[i].is_shard() == spec.placements[i].is_shard() &&
                      (!want[i].is_shard() || want[i].dim() == spec.placements[i].dim());
      }
      DTENSOR_CHECK(
          same_shards,
          "to_local(grad_placements): {} do not fit a local tensor of {} (one placement "
          "per mesh dimension; Shard where it is sharded, Replicate or Partial elsewhere)",
          to_string(*grad_placements), spec.to_string());
      spec.placements = std::move(want);
    }
    save_spec(ctx, spec);
    return m.local.view_as(m.local);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor()};
    }
    if (ctx->saved_data.count("plain") != 0) {
      return {grads[0], at::Tensor()}; // the resolved value was plain: so is its gradient
    }
    const DTensorSpec& spec = saved_spec(ctx);
    return {detail::make_dtensor(dense_in_order_of(grads[0], spec.stride), spec), at::Tensor()};
  }
};

struct RedistributeFn : torch::autograd::Function<RedistributeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& dt, const Placements& target) {
    const auto& m = detail::checked_meta(dt, "redistribute");
    save_spec(ctx, m.spec);
    at::Tensor local = detail::redistribute_local(m.local, m.spec, target);
    DTensorSpec spec = m.spec;
    spec.placements = detail::normalize_placements(target, spec.shape, "redistribute");
    return detail::make_dtensor(local, std::move(spec));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const DTensorSpec& spec = saved_spec(ctx);
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor()};
    }
    return {grad_to(grads[0], grad_placements(spec.placements)), at::Tensor()};
  }
};

} // namespace

DTensor::DTensor(const at::Tensor& t) : at::Tensor(t) {
  detail::checked_meta(t, "DTensor");
}

bool is_dtensor(const at::Tensor& t) {
  return detail::dtensor_meta(t) != nullptr;
}

const DTensorSpec& DTensor::spec() const {
  return detail::checked_meta(*this, "DTensor::spec").spec;
}

const Placements& DTensor::placements() const {
  return spec().placements;
}

const DeviceMesh& DTensor::device_mesh() const {
  return spec().mesh;
}

namespace {

// [Note: agreeing on sizes] (lib/mesh/size_check.cpp): without a shape, the global shape is
// each rank's guess from its own local tensor. Ranks whose local tensors differ would hold
// DTensors of different global shapes, and their first collective would abort a process on
// Gloo or return garbage. One uncounted exchange of the shapes over the mesh makes that an
// error on every rank here, naming each rank's tensor. Gloo meshes of 2+ ranks only (as the
// public collectives); with a shape given, the caller vouches for it.
void agree_local_shapes(const at::Tensor& local, const DeviceMesh& mesh,
                        const Placements& placements, const std::vector<int64_t>& global) {
  if (mesh.size() < 2 || mesh.device_type() != c10::kCPU || !detail::agree_on_sizes_enabled()) {
    return;
  }
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    if (mesh.get_group(d).backend_type() != BackendType::Gloo) {
      return;
    }
  }
  detail::agree_on_sizes(fmt::format("DTensor::from_local({} on {}, no shape given)",
                                     to_string(placements), mesh.to_string()),
                         {detail::shape_fingerprint(global, local.scalar_type())},
                         fmt::format("local {} {} (global {})", local.sizes(),
                                     c10::toString(local.scalar_type()), global),
                         mesh);
}

} // namespace

DTensor DTensor::from_local(const at::Tensor& local, const DeviceMesh& mesh,
                            const Placements& placements, std::optional<std::vector<int64_t>> shape,
                            std::optional<std::vector<int64_t>> stride) {
  DTENSOR_CHECK(local.defined(), "DTensor::from_local: undefined local tensor");
  DTENSOR_CHECK(!is_dtensor(local), "DTensor::from_local: the local tensor is already a DTensor");
  DTENSOR_CHECK(mesh.defined(), "DTensor::from_local: undefined mesh");
  DTENSOR_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(),
                "DTensor::from_local: {} placements {} for a mesh of {} dimensions {}",
                placements.size(), to_string(placements), mesh.ndim(), mesh.to_string());
  DTENSOR_CHECK(!local.is_meta() || mesh.device_type() == c10::kMeta,
                "DTensor::from_local: local tensor on {} but the mesh is {}", local.device().str(),
                mesh.to_string());
  // [Note: tensors follow the mesh's device]; autograd goes back through the copy.
  const at::Tensor on_mesh =
      detail::to_rank_device(local, mesh.device_type(), "DTensor::from_local", mesh.to_string());
  std::vector<int64_t> global = local.sizes().vec();
  if (shape) {
    global = *shape;
  } else {
    auto nd = static_cast<int64_t>(global.size());
    for (size_t i = 0; i < placements.size(); ++i) {
      if (placements[i].is_shard()) {
        int64_t d = placements[i].normalized(nd).dim();
        global[static_cast<size_t>(d)] *= mesh.size(static_cast<int64_t>(i));
      }
    }
  }
  if (!shape) {
    agree_local_shapes(local, mesh, placements, global);
  }
  DTensorSpec spec = detail::make_spec(mesh, placements, global, local.scalar_type(), stride);
  return DTensor(FromLocalFn::apply(on_mesh.contiguous(), spec));
}

// [Note: DTensor as an autograd input]
// Function::apply must see an at::Tensor, not the derived DTensor: its argument matching
// would otherwise take the generic (non-variable) overload and drop the autograd edge.
at::Tensor DTensor::to_local(const std::optional<Placements>& grad_placements) const {
  return ToLocalFn::apply(static_cast<const at::Tensor&>(*this), grad_placements);
}

DTensor DTensor::redistribute(const DeviceMesh& mesh, const Placements& placements,
                              bool async_op) const {
  DTENSOR_CHECK(mesh == device_mesh(),
                "DTensor::redistribute: moving between meshes is not supported ({} -> {})",
                device_mesh().to_string(), mesh.to_string());
  (void)async_op; // every step waits for its collective; the flag is accepted for API parity
  return DTensor(RedistributeFn::apply(static_cast<const at::Tensor&>(*this), placements));
}

DTensor DTensor::redistribute(const Placements& placements) const {
  return redistribute(device_mesh(), placements);
}

at::Tensor DTensor::full_tensor() const {
  Placements all(placements().size(), Placement::replicate());
  return redistribute(all).to_local();
}

DTensor distribute_tensor(const at::Tensor& tensor, const DeviceMesh& mesh,
                          const Placements& placements, std::optional<int> src_data_rank) {
  DTENSOR_CHECK(tensor.defined(), "distribute_tensor: undefined tensor");
  DTENSOR_CHECK(!is_dtensor(tensor), "distribute_tensor: the tensor is already a DTensor");
  // A meta tensor (a module built on the meta device) gives a meta DTensor: its local piece
  // is cut without data or communication, and dtensor::to_empty allocates it later.
  const bool meta = tensor.is_meta();
  for (int64_t i = 0; src_data_rank && i < mesh.ndim(); ++i) {
    DTENSOR_CHECK(*src_data_rank >= 0 && *src_data_rank < mesh.size(i),
                  "distribute_tensor: src_data_rank {} is not a group rank of mesh dimension {} "
                  "(size {}) of {}",
                  *src_data_rank, i, mesh.size(i), mesh.to_string());
  }
  for (const auto& p : placements) {
    DTENSOR_CHECK(!p.is_partial(),
                  "distribute_tensor: placement {} in {}: a full tensor cannot be "
                  "distributed as Partial",
                  p.to_string(), to_string(placements));
  }
  DTensorSpec spec =
      detail::make_spec(mesh, placements, tensor.sizes().vec(), tensor.scalar_type());
  at::Tensor local = detail::to_rank_device(tensor.detach(), mesh.device_type(),
                                            "distribute_tensor", mesh.to_string())
                         .contiguous()
                         .clone();
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    if (src_data_rank &&
        !meta) { // from the source's coordinate on this dimension, within each slice
      broadcast_(local, *src_data_rank, mesh.get_group(i));
    }
    const Placement& p = spec.placements[static_cast<size_t>(i)];
    if (p.is_shard()) {
      int64_t d = p.dim();
      int64_t k = mesh.size(i);
      int64_t c = mesh.get_local_rank(i);
      int64_t n = local.size(d);
      local = local.narrow(d, chunk_offset(n, k, c), chunk_size(n, k, c)).contiguous();
    }
  }
  DTensor out(detail::make_dtensor(local, std::move(spec)));
  if (tensor.requires_grad()) {
    out.set_requires_grad(true);
  }
  return out;
}

} // namespace dtensor
