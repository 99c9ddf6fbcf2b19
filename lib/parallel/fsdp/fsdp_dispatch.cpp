// fully_shard's part of the DTensor dispatch handler: managed parameters are used
// unsharded by the ops of forward and backward, sharded by everything else.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "internal/check.h"
#include "parallel/fsdp/fsdp_state.h"
#include "parallel/tp/tensor_parallel.h"
#include "tensor/dispatch/interceptors.h"
#include "tensor/dispatch/op_args.h"

namespace dtensor::detail {

// [Note: fully_shard without module hooks]
// A unit called through dtensor::call gets its events from the module seam ([Note: fully_shard
// on the module seam] in fsdp_state.cpp). Otherwise, and for what the seam does not see, the
// units are driven from the ops themselves (the fallback trigger):
//  - Every op that reaches the DTensor handler with a managed parameter (or a view of one)
//    among its arguments comes here first. If the op is "model math" -- its other tensors
//    are plain activations -- the parameter's unit is unsharded (one all-gather for all of
//    its parameters) and the op runs on the unsharded values, giving plain results. View
//    ops (t, view, transpose, ...) return a DTensor tagged as a view of the unsharded
//    parameter, so every later use of it, including by autograd in backward, comes back
//    here and can refill a unit that was freed in the meantime.
//  - Everything else sees the parameter as what it is, a Shard DTensor: in-place writes
//    (optimizer steps, init), ops whose other DTensors live on the same mesh (gradients,
//    optimizer state), *_like factories (optimizer state creation), detach and alias.
//  - Reshard after forward: when forward moves on to another unit, every unsharded unit
//    that is neither that unit nor one of its ancestors and reshards after forward is
//    freed. The root never is (backward needs it first).
//  - Backward: gradients reach each parameter's FSDPAccumulateGrad node (param_group.cpp);
//    a unit reduce-scatters once when all of its gradients are in (reduce.cpp); a callback
//    at the end of the backward reduces what is left and reshards (fsdp_state.cpp).
//  - When collectives are issued and waited for: [Note: overlap] in fsdp_state.cpp.

namespace {

// A managed parameter (or a view of one) among the op's arguments.
struct Touch {
  size_t arg;
  int64_t element; // -1: the argument itself; else its index in a tensor list
  std::shared_ptr<FSDPParamGroup> group;
  const DTensorMeta* meta;
  std::shared_ptr<const FsdpTag> tag;
};

// The op's managed parameters (and views of them), and its other DTensors.
struct Touches {
  std::vector<Touch> touches;
  std::vector<const DTensorMeta*> others;
};

Touches find_touches(const OpArgs& args, const std::string& name) {
  Touches t;
  args.for_each_tensor([&](size_t i, int64_t element, const at::Tensor& tensor) {
    const DTensorMeta* m = dtensor_meta(tensor);
    if (m == nullptr) {
      return;
    }
    auto tag = m->extension<FsdpTag>();
    if (tag == nullptr) {
      t.others.push_back(m);
      return;
    }
    auto g = tag->group.lock();
    DTENSOR_CHECK(g != nullptr,
                  "{}: argument {} belongs to a fully_shard unit that no longer exists", name, i);
    t.touches.push_back({i, element, std::move(g), m, std::move(tag)});
  });
  return t;
}

// Whether the op sees the parameters as the sharded DTensors they are: in-place writes,
// *_like factories / detach / alias, and ops whose other DTensors share the parameter's own
// mesh (gradients, optimizer state; tensor-parallel activations live on the tp mesh, views
// on the unsharded values' mesh). Views cannot be used so.
bool sharded_use(const OpArgs& args, const Touches& t, const std::string& name) {
  bool written = false;
  for (const Touch& touch : t.touches) {
    written = written || args.writes(touch.arg);
  }
  bool sharded = written || keeps_parameters_as_dtensors(args.schema);
  for (const DTensorMeta* o : t.others) {
    for (const Touch& touch : t.touches) {
      sharded = sharded || (!touch.tag->is_view() && o->spec.mesh == touch.meta->spec.mesh);
    }
  }
  if (!sharded) {
    return false;
  }
  for (const Touch& touch : t.touches) {
    DTENSOR_CHECK(!touch.tag->is_view(),
                  "{}: argument {} '{}' is a view of an unsharded fully_shard parameter (unit "
                  "'{}'); it cannot be written in place or mixed with sharded DTensors",
                  name, touch.arg, args.name_of(touch.arg), touch.group->name);
    if (written) {
      touch.group->reshard(); // the unsharded copy, if any, is stale now
    }
  }
  return true;
}

// The value an unsharded use of `t` runs on: the unit's unsharded parameter (a DTensor for
// a tensor-parallel one), or the view's own value.
at::Tensor unsharded_value(const Touch& t) {
  switch (t.tag->role) {
  case FsdpRole::Parameter:
    return t.group->unsharded_value(t.tag->index);
  case FsdpRole::UnshardedView:
    return t.meta->local;
  case FsdpRole::UnshardedDTensorView:
    break;
  }
  at::Tensor dt = make_dtensor(t.meta->local, t.meta->spec); // without the fully_shard tag
  set_tp_tag(dt, t.meta->extension<TpTag>());
  return dt;
}

// Unsharded use: every touched unit is unsharded, and the op's arguments become their
// unsharded values. [Note: plain units next to tensor parallelism] A unit without
// tensor-parallel parameters (a norm) used with DTensor activations (of a tensor-parallel
// neighbour) takes part as Replicate over their mesh; its gradient comes back as a DTensor
// there and is reduced to Replicate before the reduce-scatter.
void substitute_unsharded(const OpArgs& args, const Touches& t, const std::string& name) {
  const bool backward = in_backward();
  for (const Touch& touch : t.touches) {
    touch.group->fsdp_state().ready_for_use(backward);
  }
  for (const Touch& touch : t.touches) {
    // A later touch may have resharded an earlier one's unit (two units in one op).
    DTENSOR_CHECK(touch.group->state == ShardState::Unsharded,
                  "{}: parameters of units '{}' and others are used together; a parameter shared "
                  "between units must belong to their common ancestor",
                  name, touch.group->name);
  }
  const DeviceMesh* activation_mesh = t.others.empty() ? nullptr : &t.others.front()->spec.mesh;
  for (const Touch& touch : t.touches) {
    at::Tensor v = unsharded_value(touch);
    if (activation_mesh != nullptr && dtensor_meta(v) == nullptr) {
      v = as_replicate(v, *activation_mesh);
    }
    args.set(touch.arg, touch.element, v);
  }
}

// [Note: no input casting] (fully_shard.h): with mp_policy.param_dtype, floating inputs must
// already be in it. Forward only: backward's arguments come from autograd, and some are
// rightly in another dtype (CUDA's layer norm saves its mean and rstd in float32 for a
// bfloat16 input; CPU's in the input's dtype: seen on a GPU, docs/testing.md). The dtype is
// the one the op sees the unit's parameter in: param_dtype, unless the module cast it itself
// (an MoE router's gate in float32, as Hugging Face's and torchtitan's routers compute their
// scores): then its inputs must be in that dtype.
void check_input_dtypes(const OpArgs& args, const Touches& t, const std::string& name) {
  const FSDPParamGroup& group = *t.touches.front().group;
  if (group.param_dtype == group.orig_dtype || in_backward()) {
    return;
  }
  c10::ScalarType want = group.param_dtype;
  const Touch& first = t.touches.front();
  if (first.element < 0 && args[first.arg].isTensor() && args[first.arg].toTensor().defined() &&
      args[first.arg].toTensor().is_floating_point()) {
    want = args[first.arg].toTensor().scalar_type();
  }
  for (size_t i = 0; i < args.count; ++i) {
    const c10::IValue& v = args[i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_floating_point() &&
        v.toTensor().dim() > 0) {
      DTENSOR_CHECK(
          v.toTensor().scalar_type() == want,
          "{}: argument {} '{}' is {} but unit '{}' runs in mp_policy.param_dtype {}{}; "
          "call the module through dtensor::call, whose fully_shard hooks cast its inputs "
          "(FSDP2's cast_forward_inputs), or cast them to {} (module->forward runs no hooks)",
          name, i, args.name_of(i), c10::toString(v.toTensor().scalar_type()), group.name,
          c10::toString(group.param_dtype),
          want == group.param_dtype
              ? std::string()
              : fmt::format(" (its parameter cast to {} here)", c10::toString(want)),
          c10::toString(want));
    }
  }
}

// A view of an unsharded value, tagged so that its later uses (autograd's too) come back.
at::Tensor tag_view(const at::Tensor& out, const Touch& source) {
  auto tag = std::make_shared<FsdpTag>();
  tag->group = source.group;
  if (dtensor_meta(out) != nullptr) {
    // Tensor parallelism: the view is a DTensor already (fresh from the handler).
    tag->role = FsdpRole::UnshardedDTensorView;
    set_fsdp_tag(out, std::move(tag));
    return out;
  }
  tag->role = FsdpRole::UnshardedView;
  at::Tensor dt = as_replicate(out, source.meta->spec.mesh);
  set_fsdp_tag(dt, std::move(tag));
  return dt;
}

// After the op: views of unsharded values stay tagged, so their later uses come back here.
void tag_view_outputs(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Touches& t) {
  const auto& schema = op.schema();
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t r = 0; r < nret; ++r) {
    const int64_t src = aliased_argument(schema, r);
    const Touch* source = nullptr;
    for (const Touch& touch : t.touches) {
      if (static_cast<int64_t>(touch.arg) == src) {
        source = &touch;
      }
    }
    if (source == nullptr) {
      continue;
    }
    c10::IValue& slot = (*stack)[rbase + r];
    if (slot.isTensor() && slot.toTensor().defined()) {
      assign_ivalue(slot, tag_view(slot.toTensor(), *source));
    } else if (slot.isTensorList()) {
      c10::List<at::Tensor> wrapped;
      for (const at::Tensor& out : slot.toTensorVector()) {
        wrapped.push_back(tag_view(out, *source));
      }
      assign_ivalue(slot, wrapped);
    }
  }
}

// The interceptor: runs model math on unsharded parameters ([Note: fully_shard without
// module hooks]); returns false to leave sharded uses to the generic handler.
bool fsdp_intercept(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const OpArgs args(op, stack);
  const std::string& name = op_full_name(op);
  const Touches t = find_touches(args, name);
  if (t.touches.empty() || sharded_use(args, t, name)) {
    return false;
  }
  substitute_unsharded(args, t, name);
  check_input_dtypes(args, t, name);
  op.callBoxed(*stack);
  tag_view_outputs(op, stack, t);
  return true;
}

[[maybe_unused]] const bool fsdp_interceptor_registered =
    register_interceptor({"fully_shard", /*order=*/10, fsdp_intercept, nullptr, wants_extensions});

// Inside dtensor::local_map ([Note: local regions] in lib/tensor/dispatch/interceptors.h): a
// managed parameter is its unit's unsharded value, as for any op of forward and backward (an
// expert-parallel weight: its Shard(0) DTensor on the ep mesh, whose local experts the region
// computes on). A view of an unsharded value is its own value already.
at::Tensor fsdp_local_source(const at::Tensor& t) {
  const DTensorMeta* m = dtensor_meta(t);
  auto tag = m != nullptr ? m->extension<FsdpTag>() : nullptr;
  if (tag == nullptr || tag->role != FsdpRole::Parameter) {
    return {};
  }
  auto group = tag->group.lock();
  DTENSOR_CHECK(group != nullptr,
                "local_map: a parameter belongs to a fully_shard unit that no longer exists");
  group->fsdp_state().ready_for_use(in_backward());
  return group->unsharded_value(tag->index);
}

[[maybe_unused]] const bool fsdp_local_source_registered =
    register_local_source_resolver(fsdp_local_source);

} // namespace

} // namespace dtensor::detail
