#pragma once

// Sharding propagation: for each aten op, a rule maps the placements of its DTensor
// arguments to the placements the op needs them in and the placements of its outputs. This
// header is what a rule sees (OpInfo), what it decides (OpSharding) and the helpers rules
// share; the registry that finds a rule by op name is registry.h. Rules live in
// lib/tensor/ops/, one file per op family.

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

#include <dtensor/dtensor_spec.h>

#include "tensor/placement_helpers.h"

namespace dtensor::detail {

// A DTensor argument's spec as the handler found it, or none: reads like
// std::optional<DTensorSpec> (if (s), *s, s->shape, s.has_value()), copies nothing. It points
// into the argument's own state, which the handler keeps alive while the op is dispatched.
class SpecRef {
 public:
  SpecRef() = default;
  explicit SpecRef(const DTensorSpec* spec) : spec_(spec) {}
  bool has_value() const { return spec_ != nullptr; }
  explicit operator bool() const { return spec_ != nullptr; }
  const DTensorSpec& operator*() const { return *spec_; }
  const DTensorSpec* operator->() const { return spec_; }
  bool operator==(std::nullopt_t) const { return spec_ == nullptr; }

 private:
  const DTensorSpec* spec_ = nullptr;
};

// What a rule sees: the op, its arguments (DTensors described by their specs, everything
// else as IValues) and the mesh they share.
struct OpInfo {
  const c10::OperatorHandle* op = nullptr;
  std::string_view name; // "aten::add.Tensor" (op_full_name's, alive for this thread)
  const DeviceMesh* mesh = nullptr;
  // One entry per schema argument: the spec of a DTensor argument, none otherwise.
  // (Inline storage for eight arguments: building an OpInfo allocates nothing for most ops.)
  c10::SmallVector<SpecRef, 8> specs;
  // For TensorList arguments: the specs of their elements.
  c10::SmallVector<std::vector<DTensorSpec>, 8> list_specs;
  c10::ArrayRef<c10::IValue> args; // the original arguments (DTensors unreplaced)

  const c10::IValue& arg(size_t i) const { return args[i]; }
  size_t num_args() const { return specs.size(); }
  int64_t mesh_ndim() const { return mesh->ndim(); }
};

struct OpSharding;
// A replacement for the local op: it finds the local arguments at the end of the stack (as
// the op would) and leaves the local results there. Random ops use it to draw their piece of
// a layout-independent global tensor ([Note: layout-independent random numbers]).
using LocalKernel = void (*)(const OpInfo& info, const OpSharding& sharding,
                             torch::jit::Stack* stack);

// What a rule decides.
struct OpSharding {
  // Per argument: the placements it must have (redistributed if it differs); nullopt keeps it.
  std::vector<std::optional<Placements>> inputs;
  // For TensorList arguments: the placements every element must have.
  std::vector<std::optional<Placements>> list_inputs;
  // Per returned tensor (in schema order): its placements. Aliasing returns (in-place and
  // out= ops) keep their argument's and may be left empty.
  std::vector<Placements> outputs;
  // Per argument: a replacement for the local call (shape arguments such as view's size are
  // global; the local op needs this rank's local shape).
  std::vector<std::optional<c10::IValue>> local_args;
  // Optional: the global shape of each returned tensor, for rules that know it (pointwise
  // ops: the broadcast shape). Otherwise the handler runs the op on meta tensors once.
  std::vector<std::vector<int64_t>> output_shapes;
  // Optional: runs instead of the op on the local arguments.
  LocalKernel local_kernel = nullptr;
  // Optional, for ops that have no C++ meta kernel (adaptive pools, max_unpool2d, CUDA
  // attention): outputs are sharded on dims [0, n) only, where their global sizes are input
  // 0's; every other size is the local result's.
  int64_t leading_dims_from_input = 0;
};

using ShardingRule = OpSharding (*)(const OpInfo& info);

// Helpers shared by rules.
// The rule of ops computed on whole tensors: every DTensor argument Replicate, every output
// Replicate (nll_loss, item, equal, ...; also [Note: the replicated fallback]).
OpSharding all_replicate(const OpInfo& info);
// Ops on one tensor (argument 0) laid out as `want`; any other DTensor argument Replicate;
// `num_outputs` outputs laid out as `out`.
OpSharding single_input(const OpInfo& info, const Placements& want, const Placements& out,
                        size_t num_outputs);
// The error for an op the rule cannot shard as given.
[[noreturn]] void fail_unsupported(const OpInfo& info, const std::string& why);
std::string describe_args(const OpInfo& info); // "(Shard(0), Replicate()) Float[8, 4], 2.0, ..."

} // namespace dtensor::detail
