// fully_shard's part of the DTensor dispatch handler: managed parameters are used
// unsharded by the ops of forward and backward, sharded by everything else.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include "internal/check.h"
#include "internal/fsdp.h"
#include "internal/sharding.h"
#include "internal/tensor_parallel.h"

namespace dtensor::detail {

// [Note: fully_shard without module hooks]
// C++ modules have no forward hooks, so the units are driven from the ops themselves:
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
//    a unit reduce-scatters once when all of its gradients are in; a callback at the end
//    of the backward reduces what is left and reshards.

namespace {

std::string op_name(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

// Out of line: inlined into fsdp_intercept, GCC 12 reports a false stringop-overflow in
// IValue's refcounting.
[[gnu::noinline]] void assign(c10::IValue& slot, c10::IValue value) {
  slot = std::move(value);
}

struct Touch {
  size_t arg;
  int64_t element; // -1: the argument itself; else its index in a tensor list
  std::shared_ptr<FSDPParamGroup> group;
  const DTensorMeta* meta;
};

void end_of_backward() {
  FSDPRegistry& reg = fsdp_registry();
  reg.callback_queued = false;
  auto units = live_units();
  for (auto& g : units) {
    g->end_backward();
  }
  for (auto& g : units) {
    if (g->reshard_after_backward) {
      g->reshard();
    }
  }
}

} // namespace

void fsdp_queue_final_callback() {
  FSDPRegistry& reg = fsdp_registry();
  if (!reg.callback_queued && torch::autograd::get_current_graph_task_id() != -1) {
    reg.callback_queued = true;
    torch::autograd::Engine::get_default_engine().queue_callback(end_of_backward);
  }
}

void fsdp_before_use(FSDPParamGroup& group, bool in_backward) {
  if (in_backward) {
    fsdp_queue_final_callback();
  } else {
    for (auto& other : live_units()) {
      if (other.get() != &group && other->forward_used && other->state == ShardState::Unsharded &&
          other->effective_reshard_after_forward() && !other->is_ancestor_of(group)) {
        other->reshard();
      }
    }
    group.forward_used = true;
  }
  if (group.state == ShardState::Unsharded) {
    return;
  }
  group.unshard();
  for (auto& w : in_backward ? group.backward_prefetch : group.forward_prefetch) {
    if (auto g = w.lock()) {
      g->unshard();
    }
  }
}

bool fsdp_intercept(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  std::vector<Touch> touches;
  std::vector<const DTensorMeta*> others;
  auto see = [&](const at::Tensor& t, size_t arg, int64_t element) {
    const DTensorMeta* m = dtensor_meta(t);
    if (m == nullptr) {
      return;
    }
    if (m->fsdp == nullptr) {
      others.push_back(m);
      return;
    }
    auto g = m->fsdp->group.lock();
    DTENSOR_CHECK(g != nullptr,
                  "{}: argument {} belongs to a fully_shard unit that no longer exists",
                  op_name(op), arg);
    touches.push_back({arg, element, std::move(g), m});
  };
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& v = (*stack)[base + i];
    if (v.isTensor()) {
      see(v.toTensor(), i, -1);
    } else if (v.isTensorList()) {
      int64_t e = 0;
      for (const at::Tensor& t : v.toTensorVector()) {
        see(t, i, e++);
      }
    }
  }
  if (touches.empty()) {
    return false;
  }
  const std::string name = op_name(op);

  // Sharded use?
  bool written = false;
  for (const Touch& t : touches) {
    const auto* alias = schema.arguments()[t.arg].alias_info();
    written = written || (alias != nullptr && alias->isWrite());
  }
  bool sharded = written || keeps_parameters_as_dtensors(schema);
  for (const DTensorMeta* o : others) {
    for (const Touch& t : touches) {
      // Gradients and optimizer state share the parameter's own mesh (activations of
      // tensor parallelism live on the tp mesh, views on the unsharded values' mesh).
      sharded = sharded || (!t.meta->fsdp->view && o->spec.mesh == t.meta->spec.mesh);
    }
  }
  if (sharded) {
    for (const Touch& t : touches) {
      DTENSOR_CHECK(
          !t.meta->fsdp->view,
          "{}: argument {} '{}' is a view of an unsharded fully_shard parameter (unit '{}'); "
          "it cannot be written in place or mixed with sharded DTensors",
          name, t.arg, schema.arguments()[t.arg].name(), t.group->name);
      if (written) {
        t.group->reshard(); // the unsharded copy, if any, is stale now
      }
    }
    return false;
  }

  // Unsharded use: make sure every touched unit is unsharded, then run on plain values.
  const bool in_backward = torch::autograd::get_current_graph_task_id() != -1;
  for (const Touch& t : touches) {
    fsdp_before_use(*t.group, in_backward);
  }
  for (const Touch& t : touches) {
    // A later touch may have resharded an earlier one's unit (two units in one op).
    DTENSOR_CHECK(t.group->state == ShardState::Unsharded,
                  "{}: parameters of units '{}' and others are used together; a parameter shared "
                  "between units must belong to their common ancestor",
                  name, t.group->name);
  }
  auto unsharded_value = [](const Touch& t) -> at::Tensor {
    const FsdpTag& tag = *t.meta->fsdp;
    if (!tag.view) {
      return t.group->unsharded_value(tag.index);
    }
    if (!tag.dtensor_view) {
      return t.meta->local;
    }
    at::Tensor dt = make_dtensor(t.meta->local, t.meta->spec); // without the fully_shard tag
    const_cast<DTensorMeta*>(dtensor_meta(dt))->tp = t.meta->tp;
    return dt;
  };
  // [Note: plain units next to tensor parallelism] A unit without tensor-parallel
  // parameters (a norm) used with DTensor activations (of a tensor-parallel neighbour)
  // takes part as Replicate over their mesh; its gradient comes back as a DTensor there
  // and is reduced to Replicate before the reduce-scatter.
  const DeviceMesh* activation_mesh = others.empty() ? nullptr : &others.front()->spec.mesh;
  auto value_for = [&](const Touch& t) {
    at::Tensor v = unsharded_value(t);
    if (activation_mesh != nullptr && dtensor_meta(v) == nullptr) {
      v = make_dtensor(v, make_spec(*activation_mesh, replicate_all(activation_mesh->ndim()),
                                    v.sizes().vec(), v.scalar_type(), v.strides().vec()));
    }
    return v;
  };
  for (const Touch& t : touches) {
    c10::IValue& slot = (*stack)[base + t.arg];
    if (t.element < 0) {
      assign(slot, value_for(t));
    } else {
      std::vector<at::Tensor> values = slot.toTensorVector();
      values[static_cast<size_t>(t.element)] = value_for(t);
      assign(slot, c10::List<at::Tensor>(values));
    }
  }
  const c10::ScalarType param_dtype = touches.front().group->param_dtype;
  if (param_dtype != touches.front().group->orig_dtype) {
    for (size_t i = 0; i < nargs; ++i) {
      const c10::IValue& v = (*stack)[base + i];
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_floating_point() &&
          v.toTensor().dim() > 0) {
        DTENSOR_CHECK(
            v.toTensor().scalar_type() == param_dtype,
            "{}: argument {} '{}' is {} but unit '{}' runs in mp_policy.param_dtype {}; "
            "cast the model's inputs to {} (C++ modules have no pre-forward hook to do it)",
            name, i, schema.arguments()[i].name(), c10::toString(v.toTensor().scalar_type()),
            touches.front().group->name, c10::toString(param_dtype), c10::toString(param_dtype));
      }
    }
  }

  op.callBoxed(*stack);

  // Views of unsharded values stay tagged, so their later uses come back here.
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t r = 0; r < nret; ++r) {
    const auto* alias = schema.returns()[r].alias_info();
    if (alias == nullptr || alias->isWrite()) {
      continue;
    }
    const Touch* source = nullptr;
    for (const Touch& t : touches) {
      const auto* ai = schema.arguments()[t.arg].alias_info();
      if (ai != nullptr && ai->beforeSets() == alias->beforeSets()) {
        source = &t;
      }
    }
    if (source == nullptr) {
      continue;
    }
    auto wrap = [&](const at::Tensor& out) {
      if (const DTensorMeta* om = dtensor_meta(out)) {
        // Tensor parallelism: the view is a DTensor already (fresh from the handler).
        auto tag = std::make_shared<FsdpTag>();
        tag->group = source->group;
        tag->view = true;
        tag->dtensor_view = true;
        const_cast<DTensorMeta*>(om)->fsdp = tag;
        return out;
      }
      DeviceMesh mesh = source->meta->spec.mesh;
      at::Tensor dt =
          make_dtensor(out, make_spec(mesh, replicate_all(mesh.ndim()), out.sizes().vec(),
                                      out.scalar_type(), out.strides().vec()));
      auto tag = std::make_shared<FsdpTag>();
      tag->group = source->group;
      tag->view = true;
      const_cast<DTensorMeta*>(dtensor_meta(dt))->fsdp = tag;
      return dt;
    };
    c10::IValue& slot = (*stack)[rbase + r];
    if (slot.isTensor() && slot.toTensor().defined()) {
      assign(slot, wrap(slot.toTensor()));
    } else if (slot.isTensorList()) {
      c10::List<at::Tensor> wrapped;
      for (const at::Tensor& t : slot.toTensorVector()) {
        wrapped.push_back(wrap(t));
      }
      assign(slot, wrapped);
    }
  }
  return true;
}

} // namespace dtensor::detail
