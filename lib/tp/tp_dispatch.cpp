// Tensor parallelism's part of the DTensor dispatch handler: module input and output
// layouts, applied by the ops themselves.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/graph_task.h>

#include <set>

#include "internal/check.h"
#include "internal/dtensor_impl.h"
#include "internal/redistribute.h"
#include "internal/sharding.h"
#include "internal/tensor_parallel.h"

namespace dtensor::detail {

// [Note: tensor parallelism without module hooks]
// PyTorch's parallel styles convert a module's inputs and outputs in forward hooks. C++
// modules have none, so the conversions happen in the ops, from tags on DTensors:
//  - A parallelized module's parameters carry its style's layouts. An op that uses them
//    (linear's addmm, layer_norm, embedding, ...) first converts its other tensors, the
//    module's inputs: a plain tensor is taken as the style's input layout (only Replicate
//    can be: a plain tensor's shape is what autograd recorded, so it must be the global
//    one), DTensors are redistributed to the style's desired input layout.
//  - The op's DTensor results are tagged as that module's activations. Views of them keep
//    the tag (linear reshapes its result back inside the module). The first other op that
//    uses a tagged activation is outside the module: the activation is redistributed to
//    the style's output layout there (e.g. Partial -> Replicate, one all-reduce, or
//    Partial -> Shard(1), one reduce-scatter), with the dims of its shape at that point.
//  - Outputs stay DTensors: converting to a plain local tensor (use_local_output) would
//    change the shape autograd recorded, which only a hook above autograd could do.
// Conversions change placements, never global shapes, so they are sound below autograd.
// Ops that write a parameter in place (optimizer steps), *_like factories and ops mixing
// parameters with parameter-shaped state (weight decay) see plain DTensors.

namespace {

struct Arg {
  size_t index;
  int64_t element; // -1: the argument itself
  at::Tensor tensor;
  const DTensorMeta* meta; // nullptr for plain tensors
};

// Out of line: GCC 12 reports a false stringop-overflow in IValue's refcounting when inlined.
[[gnu::noinline]] void put(torch::jit::Stack* stack, size_t slot, const Arg& a,
                           const at::Tensor& value) {
  c10::IValue& v = (*stack)[slot];
  if (a.element < 0) {
    v = value;
  } else {
    std::vector<at::Tensor> values = v.toTensorVector();
    values[static_cast<size_t>(a.element)] = value;
    v = c10::List<at::Tensor>(values);
  }
}

// `t` (a DTensor) with placement `layout` on its 1-D mesh; the same tensor if it has it.
at::Tensor to_layout(const at::Tensor& t, const DTensorMeta& m, const Placement& layout,
                     std::shared_ptr<const TpTag> tag) {
  DTENSOR_CHECK(m.spec.mesh.ndim() == 1, "tensor parallelism: an input on {} is not on a 1-D mesh",
                m.spec.mesh.to_string());
  Placements want{layout.normalized(static_cast<int64_t>(m.spec.shape.size()))};
  if (want == m.spec.placements && tag.get() == m.tp.get()) {
    return t;
  }
  at::Tensor local =
      want == m.spec.placements ? m.local : redistribute_local(m.local, m.spec, want);
  DTensorSpec spec = m.spec;
  spec.placements = want;
  at::Tensor out = make_dtensor(local, spec);
  if (tag) {
    set_tp_tag(out, std::move(tag));
  }
  return out;
}

// Reshapes that are not views in the schema (matmul ends with _unsafe_view) also keep an
// activation inside its module.
bool reshapes_first_argument(const c10::FunctionSchema& schema) {
  static const std::set<std::string> names = {"aten::_unsafe_view", "aten::reshape",
                                              "aten::flatten",      "aten::unflatten",
                                              "aten::contiguous",   "aten::clone"};
  return names.count(schema.name()) != 0;
}

int64_t aliased_input(const c10::FunctionSchema& schema, size_t ret) {
  if (reshapes_first_argument(schema)) {
    return 0;
  }
  const auto* alias = schema.returns()[ret].alias_info();
  if (alias == nullptr || alias->isWrite()) {
    return -1;
  }
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    const auto* ai = schema.arguments()[a].alias_info();
    if (ai != nullptr && ai->beforeSets() == alias->beforeSets()) {
      return static_cast<int64_t>(a);
    }
  }
  return -1;
}

// Whether an activation leaving its module is redistributed to the output layout: always
// as the module made it; after a reshape only when Partial (the dims may have moved).
bool leaves_to_output_layout(const DTensorMeta& m) {
  if (!m.tp->output_layout) {
    return false;
  }
  if (!m.tp->viewed) {
    return true;
  }
  for (const auto& p : m.spec.placements) {
    if (p.is_partial()) {
      return true;
    }
  }
  return false;
}

} // namespace

bool keeps_parameters_as_dtensors(const c10::FunctionSchema& schema) {
  static const std::set<std::string> names = {
      "aten::empty_like",   "aten::zeros_like", "aten::ones_like",
      "aten::full_like",    "aten::rand_like",  "aten::randn_like",
      "aten::randint_like", "aten::detach",     "aten::alias"};
  return names.count(schema.name()) != 0;
}

const TpTag* tp_tag(const at::Tensor& t) {
  const DTensorMeta* m = dtensor_meta(t);
  return m != nullptr ? m->tp.get() : nullptr;
}

void set_tp_tag(const at::Tensor& dtensor, std::shared_ptr<const TpTag> tag) {
  const_cast<DTensorMeta*>(&checked_meta(dtensor, "set_tp_tag"))->tp = std::move(tag);
}

std::shared_ptr<const TpTag> tp_prepare(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  std::vector<Arg> params, activations, dtensors, plains;
  for (size_t i = 0; i < nargs; ++i) {
    const c10::IValue& v = (*stack)[base + i];
    auto see = [&](const at::Tensor& t, int64_t element) {
      if (!t.defined()) {
        return;
      }
      const DTensorMeta* m = dtensor_meta(t);
      Arg a{i, element, t, m};
      if (m == nullptr) {
        if (t.dim() > 0) {
          plains.push_back(a);
        }
      } else if (m->tp && m->tp->param) {
        params.push_back(a);
      } else if (m->tp) {
        activations.push_back(a);
      } else {
        dtensors.push_back(a);
      }
    };
    if (v.isTensor()) {
      see(v.toTensor(), -1);
    } else if (v.isTensorList()) {
      int64_t e = 0;
      for (const at::Tensor& t : v.toTensorVector()) {
        see(t, e++);
      }
    }
  }
  auto as_replicate = [&](const Arg& a, const DeviceMesh& mesh) {
    put(stack, base + a.index, a,
        make_dtensor(a.tensor, make_spec(mesh, replicate_all(mesh.ndim()), a.tensor.sizes().vec(),
                                         a.tensor.scalar_type(), a.tensor.strides().vec())));
  };
  if (torch::autograd::get_current_graph_task_id() != -1) {
    // Backward: no layouts to apply (gradients go wherever the forward's ops send them).
    // A plain tensor next to DTensors here was saved by autograd from a forward op that
    // took it as Replicate (a module input, or a plain activation next to a DTensor one).
    const Arg* any = !params.empty()        ? &params.front()
                     : !activations.empty() ? &activations.front()
                     : !dtensors.empty()    ? &dtensors.front()
                                            : nullptr;
    if (any != nullptr) {
      for (const Arg& p : plains) {
        as_replicate(p, any->meta->spec.mesh);
      }
    }
    return nullptr;
  }
  if ((params.empty() && activations.empty()) || keeps_parameters_as_dtensors(schema)) {
    return nullptr;
  }
  auto written = [&](const Arg& a) {
    const auto* alias = schema.arguments()[a.index].alias_info();
    return alias != nullptr && alias->isWrite();
  };
  for (const Arg& p : params) {
    if (written(p)) {
      return nullptr; // an optimizer step or an init: the parameter as the DTensor it is
    }
  }

  if (params.empty()) {
    // Only activations: a view keeps them inside their module; anything else is outside.
    for (size_t r = 0; r < schema.returns().size(); ++r) {
      int64_t src = aliased_input(schema, r);
      for (const Arg& a : activations) {
        if (static_cast<int64_t>(a.index) == src) {
          return a.meta->tp->viewed ? a.meta->tp : a.meta->tp->viewed_variant;
        }
      }
    }
    for (const Arg& a : activations) {
      if (!written(a) && leaves_to_output_layout(*a.meta)) {
        put(stack, base + a.index, a,
            to_layout(a.tensor, *a.meta, *a.meta->tp->output_layout, nullptr));
      }
    }
    // Plain tensors next to them (a residual branch, a mask) are whole tensors: Replicate.
    for (const Arg& p : plains) {
      as_replicate(p, activations.front().meta->spec.mesh);
    }
    return nullptr;
  }

  // A module's op: its inputs take the module's layout.
  const TpTag& tag = *params.front().meta->tp;
  const DeviceMesh& mesh = params.front().meta->spec.mesh;
  auto param_shaped = [&](const DTensorMeta& m) {
    for (const Arg& p : params) {
      if (m.spec.shape == p.meta->spec.shape && m.spec.placements == p.meta->spec.placements) {
        return true;
      }
    }
    return false;
  };
  for (const Arg& a : activations) {
    if (a.meta->tp->module == tag.module || written(a)) {
      continue; // the module's own intermediate result
    }
    at::Tensor t = leaves_to_output_layout(*a.meta)
                       ? to_layout(a.tensor, *a.meta, *a.meta->tp->output_layout, nullptr)
                       : make_dtensor(a.meta->local, a.meta->spec);
    if (tag.desired_input_layout) {
      t = to_layout(t, *dtensor_meta(t), *tag.desired_input_layout, nullptr);
    }
    put(stack, base + a.index, a, t);
  }
  for (const Arg& d : dtensors) {
    if (tag.desired_input_layout && !param_shaped(*d.meta) && !written(d)) {
      put(stack, base + d.index, d,
          to_layout(d.tensor, *d.meta, *tag.desired_input_layout, nullptr));
    }
  }
  for (const Arg& p : plains) {
    const Placement in = tag.input_layout.value_or(Placement::replicate());
    DTENSOR_CHECK(
        in.is_replicate(),
        "{}: {} on module '{}' takes its input as {}, but it got a plain tensor {}{}; a plain "
        "tensor can only stand for a Replicate input (pass a DTensor, e.g. "
        "DTensor::from_local(local, mesh, {{{}}}))",
        schema.name(), tag.style, tag.module_name, in.to_string(),
        c10::toString(p.tensor.scalar_type()), p.tensor.sizes(), in.to_string());
    DTENSOR_CHECK(!written(p),
                  "{}: argument '{}' is a plain tensor written in place with {} parameters of '{}'",
                  schema.name(), schema.arguments()[p.index].name(), tag.style, tag.module_name);
    at::Tensor t =
        make_dtensor(p.tensor, make_spec(mesh, replicate_all(1), p.tensor.sizes().vec(),
                                         p.tensor.scalar_type(), p.tensor.strides().vec()));
    if (tag.desired_input_layout) {
      t = to_layout(t, *dtensor_meta(t), *tag.desired_input_layout, nullptr);
    }
    put(stack, base + p.index, p, t);
  }
  for (size_t r = 0; r < schema.returns().size(); ++r) {
    int64_t src = aliased_input(schema, r);
    for (const Arg& p : params) {
      if (static_cast<int64_t>(p.index) == src) {
        return p.meta->tp; // a view of a parameter
      }
    }
  }
  return tag.activation;
}

} // namespace dtensor::detail
