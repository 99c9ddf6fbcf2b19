#pragma once

// fully_shard: per-parameter sharding with PyTorch FSDP2 semantics on unmodified
// torch::nn modules. Mechanism and counts: docs/fsdp.md.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <dtensor/comm_hooks.h>
#include <dtensor/device_mesh.h>
#include <dtensor/placement.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor {

namespace detail {
struct FSDPParamGroup;
} // namespace detail

// Mixed precision: parameters are all-gathered (and used in forward and backward) in
// param_dtype; gradients are reduce-scattered in reduce_dtype (default: param_dtype) and
// stored in the parameters' own dtype unless keep_low_precision_grads.
// [Note: no input casting] C++ modules have no pre-forward hook, so the model's floating
// inputs must already be in param_dtype: an op that mixes them with the unsharded
// parameters is refused with an error naming both dtypes.
struct MixedPrecisionPolicy {
  TORCH_ARG(std::optional<c10::ScalarType>, param_dtype) = std::nullopt;
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
  TORCH_ARG(bool, keep_low_precision_grads) = false;
};

// Sharded parameters, gradients (and so optimizer state) live on the CPU; each all-gather
// copies the shard to the mesh's device first. On a CPU mesh this changes nothing.
struct OffloadPolicy {
  TORCH_ARG(bool, offload_to_cpu) = false;
  TORCH_ARG(bool, pin_memory) = false;
};

struct FullyShardOptions {
  // 1-D: FSDP, parameters Shard(0) over the mesh. 2-D: HSDP, (Replicate, Shard(0)):
  // sharded over dim 1, replicated over dim 0. Default: a 1-D mesh over the world.
  TORCH_ARG(DeviceMesh, mesh);
  // Free the unsharded parameters after this unit's forward (default: true, except for
  // the root, which backward needs first).
  TORCH_ARG(std::optional<bool>, reshard_after_forward) = std::nullopt;
  TORCH_ARG(MixedPrecisionPolicy, mp_policy);
  TORCH_ARG(OffloadPolicy, offload_policy);
  // Parameters left as they are: not sharded, gradients not reduced.
  TORCH_ARG(std::vector<at::Tensor>, ignored_params);
  // Per parameter, the Shard placement to use (nullopt: Shard(0)). Dims other than 0 must
  // divide evenly by the shard group size.
  TORCH_ARG(std::function<std::optional<Placement>(const at::Tensor&)>, shard_placement_fn);
};

// The handle of a fully_shard unit (FSDP2's FSDPModule methods). Copies share the unit.
class FSDPModule {
 public:
  FSDPModule() = default;
  explicit FSDPModule(std::shared_ptr<detail::FSDPParamGroup> group);

  // All-gather this unit's parameters now / free them now.
  void unshard();
  void reshard();
  // false: backward accumulates unsharded gradients without communication (gradient
  // accumulation); the next backward with sync on reduce-scatters the sum. recurse: also
  // every fully_shard unit inside this module.
  void set_requires_gradient_sync(bool sync, bool recurse = true);
  void set_reshard_after_forward(bool reshard, bool recurse = true);
  void set_reshard_after_backward(bool reshard, bool recurse = true);
  // Units all-gathered (asynchronously) when this one is first used in forward / in
  // backward; they replace the implicit prefetch of the unit expected next.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);
  // Overlap of communication with compute (default on; docs/fsdp.md "Overlap"): the next
  // unit's all-gather is prefetched in forward and backward, and reduce-scatters stay in
  // flight until the end of the backward (a bounded number at a time). Off: every
  // collective is waited for where it is issued. Counts and values are the same.
  void set_communication_overlap(bool enable, bool recurse = true);
  // Reduced gradients are divided by this (default: the data-parallel size).
  void set_gradient_divide_factor(double factor);
  // FSDP2's all-reduce hook, for this unit: called with the unit's reduced gradient shard
  // (flat, in the reduce dtype) after the reduce-scatter and division, and with HSDP after
  // the built-in all-reduce too; it may modify it in place. On a 1-D unit it stands where
  // HSDP's all-reduce would (a "custom HSDP": all-reduce over your own replica group in
  // it). Collectives it issues through dtensor's collectives are counted. An empty
  // function removes it.
  void set_all_reduce_hook(std::function<void(at::Tensor&)> hook);
  // Reductions use only SUM collectives, with separate divisions before / after (FSDP2's
  // force_sum_reduction_for_comms). Default false: fp32 / bf16 reductions average in the
  // collective ([Note: gradient division] in lib/parallel/grad_reduce.h).
  void set_force_sum_reduction_for_comms(bool enable);
  // FSDP2's custom collectives for this unit's all-gather / reduce-scatter (comm_hooks.h).
  // An empty `call` restores the default.
  void set_custom_all_gather(CustomAllGather comm);
  void set_custom_reduce_scatter(CustomReduceScatter comm);
  // Seed 003's communication hook: on the root, for the root and every unit below it. The
  // hook's reduce_scatter replaces each unit's reduce-scatter and division (it then also
  // takes the place of a custom reduce-scatter). Errors: called on a nested unit, on a model
  // with an HSDP (2-D) unit, with a hook without a reduce_scatter, or when any of the units
  // already has a hook.
  void register_comm_hook(CommHookState state, CommHook hook);
  bool has_comm_hook() const; // this unit's
  // dtensor::clip_grad_norm_ over every parameter of the module (root units only: a
  // nested unit would clip a part of the model with a partial norm).
  at::Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);

  const DeviceMesh& mesh() const;
  bool is_root() const;      // no enclosing fully_shard unit
  // The unsharded parameters are allocated and filled; a prefetch in flight is waited for.
  bool is_unsharded() const;
  // Bytes held by the storage of the unsharded parameters (0 when resharded).
  int64_t unsharded_storage_bytes() const;
  // The parameters this unit manages (DTensors), in registration order.
  std::vector<at::Tensor> managed_parameters() const;
  bool defined() const { return group_ != nullptr; }

 private:
  std::shared_ptr<detail::FSDPParamGroup> group_;
};

// Shards `module`'s parameters that no nested unit already manages: each becomes, in
// place (same tensor, same module member, same parameters() entry), a DTensor sharded on
// dim 0 of the data-parallel mesh. Call it bottom-up: blocks first, the root last.
// Collective only in the sense that every rank must call it alike; no communication.
// Every rank must hold the same initial parameter values.
FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options = {});

// Memory fully_shard itself holds beyond the sharded state, over all units of this process:
// unsharded parameters, and the all-gather / reduce-scatter buffers while they live. The
// peak is since the last reset (benchmarks, docs/fsdp.md "Memory").
struct FSDPMemoryStats {
  int64_t unsharded_bytes = 0;
  int64_t communication_bytes = 0;
  int64_t peak_bytes = 0; // of unsharded_bytes + communication_bytes
};
FSDPMemoryStats fsdp_memory_stats();
void reset_fsdp_peak_memory();

// The unit made by fully_shard(module), if any.
std::optional<FSDPModule> fsdp_module(const torch::nn::Module& module);

} // namespace dtensor
