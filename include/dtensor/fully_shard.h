#pragma once

// fully_shard: per-parameter sharding with PyTorch FSDP2 semantics on unmodified
// torch::nn modules. Mechanism and counts: docs/fsdp.md.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <dtensor/comm_hooks.h>
#include <dtensor/device_mesh.h>
#include <dtensor/module_hooks.h>
#include <dtensor/placement.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor {

// Mixed precision: parameters are all-gathered (and used in forward and backward) in
// param_dtype; gradients are reduce-scattered in reduce_dtype (default: param_dtype) and
// stored in the parameters' own dtype unless keep_low_precision_grads.
// [Note: no input casting] The casts FSDP2 makes around a unit's forward (floating inputs to
// param_dtype when cast_forward_inputs, floating outputs to output_dtype) are the unit's
// hooks on the module seam: they happen when the unit is called through dtensor::call
// (dtensor/module_hooks.h), not when its forward is called directly. Otherwise the model's floating
// inputs must already be in param_dtype: an op that mixes them with the unsharded parameters is
// refused with an error naming both dtypes.
struct MixedPrecisionPolicy {
  TORCH_ARG(std::optional<c10::ScalarType>, param_dtype) = std::nullopt;
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
  TORCH_ARG(std::optional<c10::ScalarType>, output_dtype) = std::nullopt;
  TORCH_ARG(bool, cast_forward_inputs) = true;
  TORCH_ARG(bool, keep_low_precision_grads) = false;
};

// Sharded parameters, gradients (and so optimizer state) live on the CPU; each all-gather
// copies the shard to the mesh's device first. On a CPU mesh nothing moves. pin_memory:
// the offloaded shards are page-locked, so the copies to the GPU are asynchronous; it needs
// offload_to_cpu and a CUDA device (fully_shard refuses it otherwise, naming the module).
struct OffloadPolicy {
  TORCH_ARG(bool, offload_to_cpu) = false;
  TORCH_ARG(bool, pin_memory) = false;
};

// FSDP2's reshard_after_forward: a bool, or an int k, the size of the group the unit is
// resharded to after forward: each rank keeps the piece that it and its k - 1 neighbouring
// shard ranks rebuild the unit from, so backward all-gathers over k ranks (one host's, say)
// instead of all of them, holding S / k of the unit per rank meanwhile (S: the shard dim's
// size). k must divide S; 1 means false, S means true. docs/fsdp.md "Options".
class ReshardAfterForward {
 public:
  ReshardAfterForward(bool reshard) : reshard_(reshard) {} // NOLINT(google-explicit-constructor)
  ReshardAfterForward(int group_size) : group_size_(group_size) {}     // NOLINT
  ReshardAfterForward(int64_t group_size) : group_size_(group_size) {} // NOLINT
  bool is_group_size() const { return group_size_ >= 0; }
  int64_t group_size() const { return group_size_; }
  bool reshard() const { return reshard_; }

 private:
  bool reshard_ = true;
  int64_t group_size_ = -1; // -1: a bool
};

struct FullyShardOptions {
  // 1-D: FSDP, parameters Shard(0) over the mesh. 2-D: HSDP, (Replicate, Shard(0)):
  // sharded over dim 1, replicated over dim 0. Default: a 1-D mesh over the world.
  TORCH_ARG(DeviceMesh, mesh);
  // Free the unsharded parameters after this unit's forward (default: true, except for
  // the root, which backward needs first); or an int: ReshardAfterForward above.
  TORCH_ARG(std::optional<ReshardAfterForward>, reshard_after_forward) = std::nullopt;
  TORCH_ARG(MixedPrecisionPolicy, mp_policy);
  TORCH_ARG(OffloadPolicy, offload_policy);
  // Parameters left as they are: not sharded, gradients not reduced.
  TORCH_ARG(std::vector<at::Tensor>, ignored_params);
  // Per parameter, the Shard placement to use (nullopt: Shard(0)). Dims other than 0 must
  // divide evenly by the shard group size.
  TORCH_ARG(std::function<std::optional<Placement>(const at::Tensor&)>, shard_placement_fn);
};

// The handle of a fully_shard unit (FSDP2's FSDPModule methods). Copies share the unit.
class UnshardHandle;
class GradientReductionHandle;

class FSDPModule {
 public:
  struct Unit; // a unit inside the library (lib/parallel/fsdp/fsdp_param_group.h)

  FSDPModule() = default;
  explicit FSDPModule(std::shared_ptr<Unit> unit);

  // All-gather this unit's parameters now / free them now. async_op: return with the
  // all-gather in flight (also with communication overlap off); the handle's wait(), or the
  // unit's first use, completes it.
  UnshardHandle unshard(bool async_op = false);
  void reshard();
  // false: backward accumulates unsharded gradients without communication (gradient
  // accumulation); the next backward with sync on reduce-scatters the sum. recurse: also
  // every fully_shard unit inside this module. Sets requires_all_reduce alike (FSDP2).
  void set_requires_gradient_sync(bool sync, bool recurse = true);
  // HSDP: false keeps reduce-scattering each backward but skips the all-reduce over the
  // replicate dim: the reduced shards are summed inside the unit, .grad is left as it is;
  // the next backward with it on all-reduces the sum once and accumulates into .grad
  // (docs/fsdp.md "Controls"). No effect on 1-D units.
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  // false (for every microbatch but the last): the end of backward does not wait for the
  // reduce-scatters still in flight; they complete when the next reduce-scatter needs
  // room, or at the end of the next backward with it true (the default). .grad of the
  // units still reducing is not final until then. Set on any unit: it applies to its root's
  // whole model and stays until set again.
  void set_is_last_backward(bool is_last_backward);
  // false: backward never all-gathers this unit (nor prefetches it): for units whose
  // backward does not read the parameters (embeddings); their gradients are reduced as
  // usual. A backward that does read them fails naming the unit. This unit only.
  void set_unshard_in_backward(bool unshard_in_backward);
  // FSDP2's post-optimizer event: the next forward of this unit's root model makes its
  // device's current stream wait for `event` (recorded after the optimizer step) before
  // its first all-gather, once; then the event is dropped. dtensor issues every collective
  // on the current stream (c10d orders NCCL's stream after it), so this only matters when
  // the optimizer ran on another stream. On a CPU mesh there are no streams: the event
  // (device type cpu) is accepted and consumed by the next forward, and nothing waits.
  // An event of another device type than the mesh's is refused.
  void set_post_optim_event(c10::Event event);
  bool has_post_optim_event() const; // set and not consumed by a forward yet
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
  // The communication hook (FSDP1's register_comm_hook): on the root, for the root and every
  // unit below it. Its reduce_scatter replaces each unit's reduce-scatter and division (it also
  // takes the place of a custom reduce-scatter). HSDP units also call its all_reduce over
  // the replicate dim (docs/comm_hooks.md). Errors: called on a nested unit, with a hook
  // without a reduce_scatter (or without an all_reduce on a model with an HSDP unit), or
  // when any of the units already has a hook.
  void register_comm_hook(CommHookState state, CommHook hook);
  bool has_comm_hook() const; // this unit's
  // FSDP2's finalize_backward, for schedules that reduce gradients as a step of their own (a
  // pipeline stage's REDUCE_GRAD, docs/pipeline.md): after backwards run with gradient sync
  // off, and with it on again, one reduce-scatter (HSDP: and one all-reduce) per unit of this
  // root's model reduces the unsharded gradients they accumulated into .grad; then the units
  // whose reshard_after_backward is on are resharded. Units with sync off, or nothing
  // accumulated: no collective. Root units only, and not during a backward. async_op: returns
  // with the last reduce-scatter in flight ([Note: overlap]); the handle's wait() completes it.
  GradientReductionHandle finalize_backward(bool async_op = false);
  // dtensor::clip_grad_norm_ over every parameter of the module (root units only: a
  // nested unit would clip a part of the model with a partial norm). Defined with
  // clip_grad_norm_ (include/dtensor/clip_grad.h, linked from the same library).
  at::Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0,
                             bool error_if_nonfinite = false);
  // The unit's module's name (as in messages).
  std::string name() const;
  // Every parameter of the unit's module(s), each once, in module order (FSDP2's
  // nn.Module.parameters()).
  std::vector<at::Tensor> parameters() const;

  const DeviceMesh& mesh() const;
  bool is_root() const; // no enclosing fully_shard unit
  // The unsharded parameters are allocated and filled; a prefetch in flight is waited for.
  bool is_unsharded() const;
  // Bytes held by the storage of the unsharded parameters (0 when resharded).
  int64_t unsharded_storage_bytes() const;
  // The parameters this unit manages (DTensors), in registration order.
  std::vector<at::Tensor> managed_parameters() const;
  bool defined() const { return unit_ != nullptr; }
  bool operator==(const FSDPModule& other) const { return unit_ == other.unit_; }

 private:
  friend class UnshardHandle;
  friend class GradientReductionHandle;
  std::shared_ptr<Unit> unit_;
};

// An all-gather started by FSDPModule::unshard(async_op = true) (FSDP2's UnshardHandle).
// wait(): the all-gather has completed and the unsharded parameters are filled; forward
// waits by itself when the unit is first used without it. Waiting twice, or on a handle of
// a synchronous unshard, does nothing.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  explicit UnshardHandle(FSDPModule unit);
  void wait();

 private:
  FSDPModule unit_;
};

// A gradient reduction started by FSDPModule::finalize_backward(async_op = true). wait(): the
// reductions have completed and .grad holds the reduced gradients. Waiting twice, or on the
// handle of a synchronous finalize_backward, does nothing.
class GradientReductionHandle {
 public:
  GradientReductionHandle() = default;
  explicit GradientReductionHandle(FSDPModule root);
  void wait();

 private:
  FSDPModule root_;
};

// Shards `module`'s parameters that no nested unit already manages: each becomes, in
// place (same tensor, same module member, same parameters() entry), a DTensor sharded on
// dim 0 of the data-parallel mesh. Call it bottom-up: blocks first, the root last.
// Collective only in the sense that every rank must call it alike; no communication.
// Every rank must hold the same initial parameter values.
FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options = {});

// FSDP2's fully_shard([m1, m2, ...]): one unit over several modules, their parameters
// all-gathered and reduce-scattered together; a parameter they share (a tied embedding and
// output projection: torchtitan's [tok_embeddings, norm, output]) is managed once.
// fsdp_module() of each module gives the unit. The modules are not nested in one another's
// units; nested units inside them keep their parameters, as for one module.
FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options = {});

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

// An alias of dtensor::call (dtensor/module_hooks.h), which runs a unit's FSDP2 pre- and
// post-forward casts among its hooks; kept for code written before the module seam.
template <typename M, typename... Args>
auto fsdp_forward(M& module, Args&&... args) {
  return call(module, std::forward<Args>(args)...);
}

} // namespace dtensor
