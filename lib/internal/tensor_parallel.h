#pragma once

// The state behind tensor parallelism (include/dtensor/tensor_parallel.h). See
// [Note: tensor parallelism without module hooks] in lib/tp/tp_dispatch.cpp.
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/dispatch/Dispatcher.h>

#include <dtensor/placement.h>

namespace dtensor::detail {

// On a parameter of a parallelized module (param == true; also on views of it) or on an
// activation one of its ops produced (param == false).
struct TpTag {
  bool param = false;
  const void* module = nullptr; // the parallelized module
  std::string style;            // "ColwiseParallel", ...
  std::string module_name;
  std::optional<Placement> input_layout;         // what plain inputs are taken to be
  std::optional<Placement> desired_input_layout; // what inputs are redistributed to
  std::optional<Placement> output_layout;        // what outputs become when they leave
  std::shared_ptr<const TpTag> activation;       // on parameter tags: the tag of outputs
  // Activations reshaped after the op that made them (linear's own reshape, or the
  // caller's view): their layout may no longer be the output layout's dims, so leaving the
  // module only reduces Partial placements ([Note: tensor parallelism without module hooks]).
  bool viewed = false;
  std::shared_ptr<const TpTag> viewed_variant; // on activation tags
};

// The tag of a DTensor, or nullptr.
const TpTag* tp_tag(const at::Tensor& t);
void set_tp_tag(const at::Tensor& dtensor, std::shared_ptr<const TpTag> tag);

// Ops that see managed parameters (fully_shard, tensor parallelism) as the DTensors they
// are, never unsharded or with module layouts: *_like factories (optimizer state), detach,
// alias.
bool keeps_parameters_as_dtensors(const c10::FunctionSchema& schema);

// Before the DTensor handler decides an op: turns plain inputs of parallelized modules into
// DTensors, redistributes inputs to the module's layout and activations leaving their
// module to its output layout (rewriting the stack). Returns the tag the op's DTensor
// outputs get (nullptr: none).
std::shared_ptr<const TpTag> tp_prepare(const c10::OperatorHandle& op, torch::jit::Stack* stack);

} // namespace dtensor::detail
