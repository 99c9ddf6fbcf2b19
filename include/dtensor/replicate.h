#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include <c10/core/ScalarType.h>

#include <torch/arg.h>

#include <dtensor/comm_hooks.h>
#include <dtensor/device_mesh.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor {

struct ReplicateOptions {
  // Gradients are all-reduced in buckets of at most this many MiB (a parameter larger than
  // the cap gets a bucket of its own), filled in reverse parameter order.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  // Broadcast parameters and buffers from the mesh's first rank when replicating.
  TORCH_ARG(bool, broadcast_from_rank0) = true;
  // Reduce the buckets in this dtype (then cast back), like fully_shard's
  // mp_policy.reduce_dtype; fp16 reductions divide before and after the SUM
  // ([Note: gradient division] in lib/parallel/grad_reduce.h).
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
};

// Controls a replicated module. Keep it alive while training: the gradient hooks hold only
// a weak reference and do nothing once every handle is gone.
class ReplicateHandle {
 public:
  struct State; // the replicated module's buckets and hooks (lib/parallel/replicate.cpp)

  ReplicateHandle() = default;
  explicit ReplicateHandle(std::shared_ptr<State> state);
  // false: gradients accumulate locally, no communication (gradient accumulation); the
  // next backward with sync on all-reduces the accumulated gradients.
  void set_requires_gradient_sync(bool sync);
  int64_t num_buckets() const;
  // The communication hook (DDP's register_comm_hook) for the no-shard case: its all_reduce
  // replaces each bucket's all-reduce and division. Once only ("A communication hook is already
  // registered"); call it before the first backward.
  void register_comm_hook(CommHookState state, CommHook hook);
  bool has_comm_hook() const;
  const DeviceMesh& mesh() const;

 private:
  std::shared_ptr<State> state_;
};

// DDP semantics on an unmodified module: parameters stay plain tensors, equal on every rank
// of the 1-D `mesh`; after each backward every gradient is the average over the ranks,
// all-reduced in buckets as soon as a bucket's gradients are all accumulated (post-
// accumulate-grad hooks; buckets with unused parameters are completed with zero gradients
// when the backward pass ends, so every rank issues the same collectives whatever it used).
// Collective: every rank of the mesh calls it.
ReplicateHandle replicate(torch::nn::Module& module, const DeviceMesh& mesh,
                          const ReplicateOptions& options = {});

// The handle of `module`'s replicate, while some handle of it is alive (pipeline schedules
// find a stage's this way); nullopt otherwise.
std::optional<ReplicateHandle> replicate_handle(const torch::nn::Module& module);

} // namespace dtensor
