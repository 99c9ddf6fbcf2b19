// Tensor parallelism's part of the DTensor dispatch handler: module input and output
// layouts, applied by the ops themselves.
#include <ATen/ATen.h>

#include <set>

#include <dtensor/dtensor.h>

#include "internal/check.h"
#include "parallel/tp/tensor_parallel.h"
#include "tensor/dispatch/interceptors.h"
#include "tensor/dispatch/op_args.h"
#include "tensor/dtensor_impl.h"
#include "tensor/redistribute/redistribute.h"

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
//  - An activation is converted once: the result is kept on it (TpLeft), so every later
//    use outside the module, and autograd's uses of it in backward, see the same value.
//  - [Note: local outputs] use_local_output (PyTorch's default for Colwise / Rowwise) hands
//    the next module the output's local tensor. Below autograd that is possible only where
//    the local tensor has the global shape, i.e. where the output layout is Replicate: an
//    op whose only DTensors are such activations (a plain Linear after RowwiseParallel, a
//    loss) runs on their local tensors and gives plain results; in backward the saved
//    activation is replaced the same way, so gradients of plain parameters stay plain.
//    Other outputs (Shard) stay DTensors.
// Conversions change placements, never global shapes, so they are sound below autograd.
// Ops that write a parameter in place (optimizer steps), *_like factories and ops mixing
// parameters with parameter-shaped state (weight decay) see plain DTensors.

namespace {

struct Arg {
  size_t index;
  int64_t element; // -1: the argument itself
  at::Tensor tensor;
  const DTensorMeta* meta; // nullptr for plain tensors
  std::shared_ptr<const TpTag> tag;
};

// An op's tensor arguments by what they are to tensor parallelism.
struct Classified {
  std::vector<Arg> params, activations, dtensors, plains;
  const Arg* any_dtensor() const {
    return !params.empty()        ? &params.front()
           : !activations.empty() ? &activations.front()
           : !dtensors.empty()    ? &dtensors.front()
                                  : nullptr;
  }
};

Classified classify(const OpArgs& args) {
  Classified c;
  args.for_each_tensor([&](size_t i, int64_t element, const at::Tensor& t) {
    if (!t.defined()) {
      return;
    }
    const DTensorMeta* m = dtensor_meta(t);
    Arg a{i, element, t, m, m != nullptr ? m->extension<TpTag>() : nullptr};
    if (m == nullptr) {
      if (t.dim() > 0) {
        c.plains.push_back(a);
      }
    } else if (a.tag && a.tag->role == TpRole::Parameter) {
      c.params.push_back(a);
    } else if (a.tag) {
      c.activations.push_back(a);
    } else {
      c.dtensors.push_back(a);
    }
  });
  return c;
}

// `t` (a DTensor) with placement `layout` on its 1-D mesh, untagged; the same tensor if it
// has that placement and no tag.
at::Tensor to_layout(const at::Tensor& t, const DTensorMeta& m, const Placement& layout) {
  DTENSOR_CHECK(m.spec.mesh.ndim() == 1, "tensor parallelism: an input on {} is not on a 1-D mesh",
                m.spec.mesh.to_string());
  Placements want{layout.normalized(static_cast<int64_t>(m.spec.shape.size()))};
  if (want == m.spec.placements && m.extension<TpTag>() == nullptr) {
    return t;
  }
  at::Tensor local =
      want == m.spec.placements ? m.local : redistribute_local(m.local, m.spec, want);
  DTensorSpec spec = m.spec;
  spec.placements = want;
  return make_dtensor(local, spec);
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
  return reshapes_first_argument(schema) ? 0 : aliased_argument(schema, ret);
}

// The argument among `args` that return values of the op are views of, if any.
const Arg* viewed_source(const c10::FunctionSchema& schema, const std::vector<Arg>& args) {
  for (size_t r = 0; r < schema.returns().size(); ++r) {
    const int64_t src = aliased_input(schema, r);
    for (const Arg& a : args) {
      if (static_cast<int64_t>(a.index) == src) {
        return &a;
      }
    }
  }
  return nullptr;
}

// Whether an activation leaving its module is redistributed to the output layout: always
// as the module made it; after a reshape only when Partial (the dims may have moved).
bool leaves_to_output_layout(const Arg& a) {
  if (!a.tag->layouts->output) {
    return false;
  }
  if (a.tag->role != TpRole::ViewedActivation) {
    return true;
  }
  for (const auto& p : a.meta->spec.placements) {
    if (p.is_partial()) {
      return true;
    }
  }
  return false;
}

// What an activation became when it left its module, kept on it ([Note: tensor
// parallelism without module hooks]); valid while the activation is not written.
struct TpLeft {
  at::Tensor value;
  int64_t version = 0;
};

at::Tensor cached_left(const Arg& a) {
  auto left = a.meta->extension<TpLeft>();
  return left && left->version == a.tensor._version() ? left->value : at::Tensor();
}

// An activation leaving its module: in the module's output layout, or as it is (untagged).
at::Tensor leaving(const Arg& a) {
  if (at::Tensor left = cached_left(a); left.defined()) {
    return left;
  }
  at::Tensor left = leaves_to_output_layout(a)
                        ? to_layout(a.tensor, *a.meta, *a.tag->layouts->output)
                        : make_dtensor(a.meta->local, a.meta->spec);
  mutable_dtensor_meta(a.tensor)->set_extension(
      std::make_shared<const TpLeft>(TpLeft{left, a.tensor._version()}));
  return left;
}

// Whether leaving(a) gives a Replicate DTensor (decided before converting anything).
bool leaves_as_replicate(const Arg& a) {
  if (leaves_to_output_layout(a)) {
    return a.tag->layouts->output->is_replicate();
  }
  for (const auto& p : a.meta->spec.placements) {
    if (!p.is_replicate()) {
      return false;
    }
  }
  return true;
}

// [Note: local outputs] When the op's only DTensors are activations of modules with
// use_local_output, each of which leaves as Replicate, they become their local tensors and
// the op runs as a plain op. In backward only activations converted in forward qualify.
// A view of an activation in forward stays in its module (linear's own reshapes).
bool make_local(const OpArgs& args, const Classified& c, bool backward) {
  if (!c.params.empty() || !c.dtensors.empty() || c.activations.empty() ||
      (!backward && viewed_source(args.schema, c.activations) != nullptr)) {
    return false;
  }
  for (const Arg& a : c.activations) {
    if (!a.tag->layouts->local_output || args.writes(a.index) || !leaves_as_replicate(a) ||
        (backward && !cached_left(a).defined())) {
      return false;
    }
  }
  for (const Arg& a : c.activations) {
    args.set(a.index, a.element, dtensor_meta(leaving(a))->local);
  }
  return true;
}

// Backward: no layouts to apply (gradients go wherever the forward's ops send them). A plain
// tensor next to DTensors here was saved by autograd from a forward op that took it as
// Replicate (a module input, or a plain activation next to a DTensor one).
// Activations converted in forward are used as converted.
void prepare_backward(const OpArgs& args, const Classified& c) {
  if (make_local(args, c, /*backward=*/true)) {
    return;
  }
  for (const Arg& a : c.activations) {
    if (at::Tensor left = cached_left(a); left.defined()) {
      args.set(a.index, a.element, left);
    }
  }
  if (const Arg* any = c.any_dtensor()) {
    for (const Arg& p : c.plains) {
      args.set(p.index, p.element, as_replicate(p.tensor, any->meta->spec.mesh));
    }
  }
}

// Only activations: a view keeps them inside their module; anything else is outside.
std::shared_ptr<const TpTag> prepare_activations(const OpArgs& args, const Classified& c) {
  if (const Arg* src = viewed_source(args.schema, c.activations)) {
    return src->tag->role == TpRole::ViewedActivation ? src->tag : src->tag->viewed_variant;
  }
  for (const Arg& a : c.activations) {
    if (!args.writes(a.index) && leaves_to_output_layout(a)) {
      args.set(a.index, a.element, leaving(a));
    }
  }
  // Plain tensors next to them (a residual branch, a mask) are whole tensors: Replicate.
  for (const Arg& p : c.plains) {
    args.set(p.index, p.element, as_replicate(p.tensor, c.activations.front().meta->spec.mesh));
  }
  return nullptr;
}

// [Note: gradients of plain inputs] A plain tensor that requires grad and enters a module's
// op as Replicate gets its gradient from the op's backward as a DTensor (Partial for a
// column-wise Linear). PyTorch's input hook makes it a DTensor above autograd (from_local),
// whose backward all-reduces that gradient and hands back a plain tensor; here a gradient hook
// on the tensor does the same: a DTensor gradient becomes its full value (one all-reduce for
// Partial, none for Replicate), so x.grad and the gradients flowing into plain ops before the
// module are plain and whole. Several uses of the tensor by parallelized ops add up in one
// gradient, converted once (the hooks after the first see a plain tensor).
void plain_gradient_hook(const at::Tensor& plain) {
  plain.register_hook([](const at::Tensor& grad) { return plain_gradient(grad); });
}

// A plain input of a module's op: the style's input layout, which only Replicate can be.
at::Tensor plain_input(const OpArgs& args, const Arg& p, const TpTag& tag, const DeviceMesh& mesh) {
  const Placement in = tag.layouts->input.value_or(Placement::replicate());
  DTENSOR_CHECK(
      in.is_replicate(),
      "{}: {} on module '{}' takes its input as {}, but it got a plain tensor {}{}; a plain "
      "tensor can only stand for a Replicate input (pass a DTensor, e.g. "
      "DTensor::from_local(local, mesh, {{{}}}))",
      args.schema.name(), tag.style, tag.module_name, in.to_string(),
      c10::toString(p.tensor.scalar_type()), p.tensor.sizes(), in.to_string());
  DTENSOR_CHECK(!args.writes(p.index),
                "{}: argument '{}' is a plain tensor written in place with {} parameters of '{}'",
                args.schema.name(), args.name_of(p.index), tag.style, tag.module_name);
  if (p.tensor.requires_grad() && !in_backward()) {
    plain_gradient_hook(p.tensor);
  }
  return as_replicate(p.tensor, mesh);
}

// A module's op: its inputs take the module's layout; its results are its activations.
std::shared_ptr<const TpTag> prepare_module_op(const OpArgs& args, const Classified& c) {
  const TpTag& tag = *c.params.front().tag;
  const DeviceMesh& mesh = c.params.front().meta->spec.mesh;
  const auto& desired = tag.layouts->desired_input;
  auto to_desired = [&](const at::Tensor& t) {
    return desired ? to_layout(t, *dtensor_meta(t), *desired) : t;
  };
  auto param_shaped = [&](const DTensorMeta& m) {
    for (const Arg& p : c.params) {
      if (m.spec.shape == p.meta->spec.shape && m.spec.placements == p.meta->spec.placements) {
        return true;
      }
    }
    return false;
  };
  for (const Arg& a : c.activations) {
    if (a.tag->module != tag.module && !args.writes(a.index)) { // not the module's own result
      args.set(a.index, a.element, to_desired(leaving(a)));
    }
  }
  for (const Arg& d : c.dtensors) {
    if (desired && !param_shaped(*d.meta) && !args.writes(d.index)) {
      args.set(d.index, d.element, to_layout(d.tensor, *d.meta, *desired));
    }
  }
  for (const Arg& p : c.plains) {
    args.set(p.index, p.element, to_desired(plain_input(args, p, tag, mesh)));
  }
  if (const Arg* src = viewed_source(args.schema, c.params)) {
    return src->tag; // a view of a parameter
  }
  return tag.activation;
}

// Before the generic handler decides an op: turns plain inputs of parallelized modules into
// DTensors, redistributes inputs to the module's layout and activations leaving their
// module to its output layout (rewriting the stack). Returns the tag the op's DTensor
// outputs get (nullptr: none).
std::shared_ptr<const TpTag> tp_prepare(const OpArgs& args) {
  const Classified c = classify(args);
  if (in_backward() && !in_recompute()) { // [Note: recompute is forward for tensor parallelism]
    prepare_backward(args, c);
    return nullptr;
  }
  if ((c.params.empty() && c.activations.empty()) || keeps_parameters_as_dtensors(args.schema) ||
      make_local(args, c, /*backward=*/false)) {
    return nullptr;
  }
  for (const Arg& p : c.params) {
    if (args.writes(p.index)) {
      return nullptr; // an optimizer step or an init: the parameter as the DTensor it is
    }
  }
  return c.params.empty() ? prepare_activations(args, c) : prepare_module_op(args, c);
}

OutputFinisher tp_interceptor(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  std::shared_ptr<const TpTag> tag = tp_prepare(OpArgs(op, stack));
  if (!tag) {
    return nullptr;
  }
  return [tag](const at::Tensor& out) { set_tp_tag(out, tag); };
}

[[maybe_unused]] const bool tp_interceptor_registered =
    register_interceptor(
        {"tensor parallelism", /*order=*/20, nullptr, tp_interceptor, wants_extensions_or_plain});

} // namespace

std::shared_ptr<const TpTag> make_tp_tags(const void* module, std::string style,
                                          std::string module_name, TpLayouts layouts) {
  auto shared = std::make_shared<TpLayouts>(std::move(layouts));
  auto tag = std::make_shared<TpTag>();
  tag->module = module;
  tag->style = std::move(style);
  tag->module_name = std::move(module_name);
  tag->layouts = shared;
  auto activation = std::make_shared<TpTag>(*tag);
  activation->role = TpRole::Activation;
  auto viewed = std::make_shared<TpTag>(*activation);
  viewed->role = TpRole::ViewedActivation;
  activation->viewed_variant = viewed;
  tag->activation = activation;
  return tag;
}

at::Tensor plain_gradient(const at::Tensor& grad) {
  return is_dtensor(grad) ? DTensor(grad).full_tensor() : grad;
}

at::Tensor tp_module_output(const at::Tensor& output, const void* module) {
  const DTensorMeta* m = dtensor_meta(output);
  auto tag = m != nullptr ? m->extension<TpTag>() : nullptr;
  // At the module's boundary a reshaped activation (Linear's 3-D output is a view of its
  // 2-D product) is the module's output as much as the product itself: the output layout
  // applies to it, as PyTorch's output hook applies it (the ops, which meet a view anywhere
  // inside the module, convert only a Partial one: leaves_to_output_layout).
  if (tag == nullptr || tag->module != module || tag->role == TpRole::Parameter ||
      !tag->layouts->output || m->spec.mesh.ndim() != 1 || (in_backward() && !in_recompute())) {
    return output;
  }
  const Placement out = *tag->layouts->output;
  DTensor converted = DTensor(output).redistribute(m->spec.mesh, {out});
  return tag->layouts->local_output && out.is_replicate() ? converted.to_local()
                                                          : at::Tensor(converted);
}

std::shared_ptr<const TpTag> tp_tag(const at::Tensor& t) {
  const DTensorMeta* m = dtensor_meta(t);
  return m != nullptr ? m->extension<TpTag>() : nullptr;
}

void set_tp_tag(const at::Tensor& dtensor, std::shared_ptr<const TpTag> tag) {
  DTensorMeta* m = mutable_dtensor_meta(dtensor);
  DTENSOR_CHECK(m != nullptr, "set_tp_tag: expected a DTensor");
  m->set_extension(std::move(tag));
}

} // namespace dtensor::detail
