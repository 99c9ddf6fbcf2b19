#pragma once

// A fully_shard unit's parameters and their buffers (FSDP2's FSDPParamGroup): the flat
// shard, the unsharded buffer, the state between them and the unit's communication
// settings. The collectives themselves are free functions (fsdp_collectives.h); when they
// run is the unit's state's business (fsdp_state.h).
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <dtensor/collectives.h>
#include <dtensor/comm_hooks.h>
#include <dtensor/fully_shard.h>

#include "parallel/fsdp/fsdp_param.h"

namespace dtensor {

// What FSDPModule holds: a param group (below), seen through the public header.
struct FSDPModule::Unit {};

} // namespace dtensor

namespace dtensor::detail {

// Unsharding: the unit's all-gather is in flight (a prefetch); its unsharded buffer is
// filled when the unit is first needed ([Note: overlap] in fsdp_state.cpp).
// ShardedPostForward: freed after forward but for the piece a smaller group rebuilds it
// from ([Note: reshard to a smaller group] in post_forward.cpp).
enum class ShardState { Sharded, ShardedPostForward, Unsharding, Unsharded };

struct PendingGather;    // an all-gather in flight (fsdp_collectives.h)
struct PendingReduce;    // a reduce-scatter in flight (fsdp_collectives.h)
struct PostForwardPiece; // what a unit keeps after forward to a smaller group (post_forward.cpp)
struct FSDPState;

struct FSDPParamGroup : FSDPModule::Unit {
  // A group belongs to its unit's state (fsdp_state.h), which holds it by value:
  // shared_ptrs to a group share the state's ownership.
  explicit FSDPParamGroup(FSDPState& owner) : owner_(&owner) {}
  FSDPParamGroup(const FSDPParamGroup&) = delete;
  FSDPParamGroup& operator=(const FSDPParamGroup&) = delete;

  std::string name; // the unit's module's name, for messages
  DeviceMesh mesh;
  Group shard_group;
  int64_t shard_size = 1;
  int64_t shard_rank = 0;
  std::optional<Group> replicate_group; // HSDP
  c10::Device device{c10::kCPU};
  FullyShardOptions options;
  std::vector<FSDPParam> params;

  c10::ScalarType orig_dtype = c10::kFloat;
  c10::ScalarType param_dtype = c10::kFloat;
  c10::ScalarType reduce_dtype = c10::kFloat;
  at::Tensor flat_shard;     // this rank's padded shards, one after another
  int64_t shard_numel = 0;   // its length (equal on every rank)
  at::Tensor unsharded_flat; // every parameter unsharded, one after another
  // The unsharded buffer is the flat shard's memory ([Note: one-rank shard groups alias]
  // in param_group.cpp): a one-rank shard group without a cast.
  bool aliased = false;
  ShardState state = ShardState::Sharded;
  std::shared_ptr<PendingGather> gather; // while Unsharding
  bool forward_used = false;             // touched by forward since it was last resharded
  bool backward_used = false;            // touched by the current backward

  // FSDPModule's controls of the unit's communication.
  bool overlap = true; // set_communication_overlap
  std::optional<bool> reshard_after_forward;
  // reshard_after_forward as an int k (1 < k < shard size): the k ranks that rebuild the
  // unit after forward, and this rank's piece while it is ShardedPostForward.
  int64_t post_forward_size = 0;
  Group post_forward_group;
  std::shared_ptr<PostForwardPiece> post_forward_piece;
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true; // HSDP: [Note: partial reduce output] in fsdp_collectives.cpp
  bool unshard_in_backward = true;
  // HSDP with requires_all_reduce false: the reduced shards so far, not all-reduced, and
  // which parameters had a gradient in them.
  at::Tensor partial_reduce_output;
  std::vector<bool> partial_received;
  double gradient_divide_factor = 0;                // 0: the data-parallel size
  std::function<void(at::Tensor&)> all_reduce_hook; // set_all_reduce_hook
  bool force_sum_reduction = false;
  CustomAllGather custom_all_gather;
  CustomReduceScatter custom_reduce_scatter;
  std::optional<std::pair<CommHookState, CommHook>> comm_hook; // register_comm_hook

  FSDPState& fsdp_state() const { return *owner_; }
  std::shared_ptr<FSDPParamGroup> shared() const; // sharing the state's ownership
  FSDPShardInfo shard_info() const { return {mesh, shard_size, shard_rank}; }

  // Builds the flat shard from the parameters' full values and converts them in place.
  // Meta parameters give a unit on the meta device: no memory until to_empty.
  void init_sharded(std::vector<std::pair<std::string, at::Tensor>> named_params);
  // A unit on the meta device: allocates its flat shard (uninitialized but for the
  // padding) on `device` and rebinds the parameters to it (dtensor::to_empty).
  void to_empty(c10::Device device);
  // One all-gather of the flat shard, copied out into the unsharded buffer. With `async`
  // (a prefetch, overlap on) it returns with the all-gather in flight (Unsharding);
  // finish_unshard() waits for it and copies out. unshard() on an Unsharding unit finishes.
  // `background`: asynchronous even with overlap off (an explicit unshard(async_op)).
  void unshard(bool async = false, bool background = false);
  void finish_unshard();
  // Frees the unsharded buffer's storage (views of it, saved by autograd, stay valid and
  // are refilled by the next unshard).
  void reshard();
  // After this unit's forward: reshard(), or with an int reshard_after_forward keep the
  // piece for the smaller group (post_forward.cpp).
  void reshard_after_forward_step();
  void init_post_forward(int64_t k); // validates k; 1 and shard size mean false and true
  void drop_post_forward_piece();
  at::Tensor take_post_forward_piece();
  int64_t post_forward_bytes() const;
  int64_t unsharded_storage_bytes() const;
  // What the ops of forward and backward run on for params[index]: its unsharded value, or,
  // kept as gathered, the extension's value made from the kept tensors.
  at::Tensor unsharded_value(size_t index) const;
  // A gradient for params[index] from autograd, unsharded.
  void on_grad(size_t index, const at::Tensor& grad);
  bool has_pending_grads() const; // unsharded gradients not reduced yet
  // After a backward that failed: its unsharded gradients and per-backward flags go (the
  // parameters, unsharded or in flight, are still valid and stay).
  void drop_backward_state();
  // At the end of each backward: reduces what is pending (sync on) and starts counting
  // the next backward's gradients afresh.
  void end_backward();
  // One reduce-scatter of every received gradient (+ one all-reduce for HSDP); the
  // results accumulate into the parameters' Shard gradients. With overlap on, the
  // reduce-scatter is left in flight (queued in the root's context) and finish_reduce()
  // completes it: when too many are in flight, or at the end of the backward.
  void reduce_grads();
  void finish_reduce(PendingReduce& pending);

 private:
  FSDPState* owner_;
  bool aliases_shard() const;
  void allocate_buffers();
  void bind_params();
  void materialize(const std::vector<at::Tensor>& values);
  void accumulate_shard_grads(at::Tensor output, const std::vector<bool>& received);
};

} // namespace dtensor::detail
