#pragma once

// Sharding propagation: for each aten op, a rule maps the placements of its DTensor
// arguments to the placements the op needs them in and the placements of its outputs.
// Rules live in lib/tensor/ops/, one file per op family, and are registered by name in
// lib/tensor/ops/registry.cpp (one explicit list: no static-initialisation order games).

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string_view>

#include <dtensor/dtensor_spec.h>

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
  std::vector<SpecRef> specs;
  // For TensorList arguments: the specs of their elements.
  std::vector<std::vector<DTensorSpec>> list_specs;
  const torch::jit::Stack* args = nullptr; // the original arguments (DTensors unreplaced)

  const c10::IValue& arg(size_t i) const { return (*args)[i]; }
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

// This rank's local shape of a tensor of global `shape` laid out as `placements` on `mesh`.
std::vector<int64_t> local_shape_of(const DeviceMesh& mesh, const Placements& placements,
                                    const std::vector<int64_t>& shape);

// [Note: shape arguments] As PyTorch's op_to_shape_and_stride_idx: ops whose size (and
// stride) argument describes the output's global shape take this rank's local shape (and
// its contiguous strides) instead, computed from the output's placements and global shape.
// Rules of these ops decide placements only.
struct ShapeArgs {
  int shape = -1;  // argument index of the size
  int stride = -1; // argument index of the stride (-1: none)
};
// The table entry of `schema_name` ("aten::view"), or nullptr.
const ShapeArgs* shape_args_of(const std::string& schema_name);

using ShardingRule = OpSharding (*)(const OpInfo& info);

// The registry. Lookup tries "ns::name.overload", then "ns::name".
// `scalar_sign_only`: the rule reads no Scalar argument beyond its sign, so decisions are
// cached by the signs of Scalar arguments, not their values (optimizer steps pass
// step-dependent scalars to the same pointwise ops on every step).
void register_rule(const std::string& name, ShardingRule rule, bool scalar_sign_only = false);
bool rule_reads_scalar_sign_only(const std::string& full_name, const std::string& base_name);
ShardingRule find_rule(const std::string& full_name, const std::string& base_name);
ShardingRule exact_rule(const std::string& name); // registered under exactly this name
void unregister_rule(const std::string& name);
// Drops every cached decision (a rule changed: register_sharding).
void clear_decision_cache();
// Registers the handler on PrivateUse1 for `op` ("ns::name" or with an overload) where a
// composite kernel would run on DTensors instead (a custom op given a rule).
void route_to_handler(const std::string& op);
void register_builtin_rules(); // calls the register_* of every op family once

// Families (lib/tensor/ops/*.cpp).
void register_tensor_ops();   // clone, detach, *_like, copy_, fill_, zero_, _to_copy
void register_pointwise_ops(); // unary / binary / ternary, in-place and out=
void register_reduction_ops(); // sum, mean, amax, amin, linalg_vector_norm
void register_matmul_ops();   // mm, addmm, bmm, baddbmm
void register_view_ops();     // t, transpose, view-like
void register_nn_ops();       // softmax, layer norm, nll_loss (+ backward)
void register_attention_ops(); // the attention kernels of CPU and CUDA (+ backward)
void register_conv_ops();     // convolution (+ backward)
void register_embedding_ops(); // embedding (+ backward), vocab-sharded lookups
void register_list_ops();     // cat, stack, split, unbind
void register_dim_ops();      // cumsum, sort, topk, var, prod, any, index_select, gather, ...
void register_whole_ops();    // pooling, upsampling, tril, flip, roll, linalg, scatter, ...
void register_random_ops();   // uniform_, normal_, bernoulli, dropout, ... (lib/tensor/random/)

// Helpers shared by rules.
// A dim argument made non-negative for a tensor of `ndim` dims.
inline int64_t wrap_dim(int64_t d, int64_t ndim) { return d < 0 ? d + ndim : d; }
Placements replicate_all(int64_t mesh_ndim);
// The rule of ops computed on whole tensors: every DTensor argument Replicate, every output
// Replicate (nll_loss, item, equal, ...; also [Note: the replicated fallback]).
OpSharding all_replicate(const OpInfo& info);
// `placements` for a tensor of `shape`: negative shard dims made non-negative, each checked
// against the shape (the error names `what`, the placements and the shape).
Placements normalize_placements(const Placements& placements, const std::vector<int64_t>& shape,
                                const char* what);
// `p` with Partial placements replaced by Replicate.
Placements without_partial(const Placements& p);
// `in`'s placements with every dim in `whole` gathered and Partial reduced (for ops that
// are not linear); shards on the other dims stay.
Placements keep_other_shards(const DTensorSpec& in, const std::vector<bool>& whole);
// Ops on one tensor (argument 0) laid out as `want`; any other DTensor argument Replicate;
// `num_outputs` outputs laid out as `out`.
OpSharding single_input(const OpInfo& info, const Placements& want, const Placements& out,
                        size_t num_outputs);
// The error for an op the rule cannot shard as given.
[[noreturn]] void fail_unsupported(const OpInfo& info, const std::string& why);
std::string describe_args(const OpInfo& info); // "(Shard(0), Replicate()) Float[8, 4], 2.0, ..."

// Size and bound of the handler's decision cache (dtensor::cache_sizes).
size_t decision_cache_size();
size_t decision_cache_bound();

// Ensures the op dispatcher routes DTensors to dtensor (once per process).
void ensure_dispatch_registered();

} // namespace dtensor::detail
