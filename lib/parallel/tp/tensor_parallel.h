#pragma once

// The state behind tensor parallelism (include/dtensor/tensor_parallel.h). See
// [Note: tensor parallelism without module hooks] in lib/parallel/tp/tp_dispatch.cpp.
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include <dtensor/placement.h>

namespace dtensor::detail {

// What a DTensor is to tensor parallelism, carried as its TpTag extension ([Note: DTensor
// extensions] in lib/tensor/dtensor_impl.h).
enum class TpRole {
  Parameter,       // a parameter of a parallelized module (also views of it)
  Activation,      // a result of one of the module's ops
  ViewedActivation // an activation reshaped after the op that made them ([Note: tensor
                   // parallelism without module hooks]): leaving the module only reduces
                   // Partial placements, as its dims may have moved
};

// A parallelized module's layouts, shared by the tags of its parameters and activations;
// PrepareModuleInput / PrepareModuleOutput edit them in place.
struct TpLayouts {
  std::optional<Placement> input;         // what plain inputs are taken to be
  std::optional<Placement> desired_input; // what inputs are redistributed to
  std::optional<Placement> output;        // what outputs become when they leave
  bool local_output = false;              // use_local_output ([Note: local outputs])
};

struct TpTag {
  TpRole role = TpRole::Parameter;
  const void* module = nullptr; // the parallelized module
  std::string style;            // "ColwiseParallel", ...
  std::string module_name;
  std::shared_ptr<TpLayouts> layouts;
  std::shared_ptr<const TpTag> activation;     // on parameter tags: the tag of outputs
  std::shared_ptr<const TpTag> viewed_variant; // on activation tags
};

// A module's three tags (parameter, activation, viewed activation) over new layouts.
std::shared_ptr<const TpTag> make_tp_tags(const void* module, std::string style,
                                          std::string module_name, TpLayouts layouts);

// An output of `module` as PyTorch's output hook leaves it, for a module called through
// dtensor::call ([Note: tensor parallelism on the module seam]): an activation the module made is
// redistributed to the style's output layout above autograd (differentiable, PyTorch's
// Redistribute backward) and, with use_local_output and a Replicate layout, handed over as
// its local tensor, in forward and in activation checkpointing's recompute (which must build
// the same graph). Anything else (not this module's activation or a view of one, a 2-D
// mesh, a call in backward) is returned as it is, for the ops to convert.
at::Tensor tp_module_output(const at::Tensor& output, const void* module);

// [Note: gradients of plain inputs] in tp_dispatch.cpp: the gradient a plain tensor gets,
// from one a parallelized op computed (a DTensor's full value; a plain one unchanged).
at::Tensor plain_gradient(const at::Tensor& grad);

// The tag of a DTensor, or nullptr.
std::shared_ptr<const TpTag> tp_tag(const at::Tensor& t);
void set_tp_tag(const at::Tensor& dtensor, std::shared_ptr<const TpTag> tag);

} // namespace dtensor::detail
