#pragma once

// The state behind fully_shard (include/dtensor/fully_shard.h). See docs/fsdp.md and
// [Note: fully_shard without module hooks] in lib/parallel/fsdp/fsdp_dispatch.cpp.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>

#include <dtensor/collectives.h>
#include <dtensor/dtensor_spec.h>
#include <dtensor/fully_shard.h>

#include "internal/torch_compat.h"
#include "parallel/end_of_backward.h"
#include "parallel/tp/tensor_parallel.h"
#include "tensor/dtensor_impl.h"

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor::detail {

// What a DTensor is to fully_shard, carried as its FsdpTag extension ([Note: DTensor
// extensions]).
enum class FsdpRole {
  Parameter,           // a managed parameter (sharded); `index` names it in its unit
  UnshardedView,       // a view of a unit's unsharded parameter (its local tensor is the view)
  UnshardedDTensorView // the same for a tensor-parallel parameter (the view is a DTensor)
};

struct FsdpTag {
  std::weak_ptr<FSDPParamGroup> group;
  size_t index = 0;
  FsdpRole role = FsdpRole::Parameter;
  bool is_view() const { return role != FsdpRole::Parameter; }
};

// Unsharding: the unit's all-gather is in flight (a prefetch); its unsharded buffer is
// filled when the unit is first needed ([Note: overlap] in lib/parallel/fsdp/schedule.cpp).
// ShardedPostForward: freed after forward but for the piece a smaller group rebuilds it
// from ([Note: reshard to a smaller group] in post_forward.cpp).
enum class ShardState { Sharded, ShardedPostForward, Unsharding, Unsharded };

// FSDP2's TrainingState, for units called through the module seam ([Note: fully_shard on the
// module seam] in schedule.cpp): Forward between its pre- and post-forward hooks,
// PreBackward from its pre-backward hook to the end of backward, Idle otherwise (always,
// for a unit driven by its ops only).
enum class TrainingState { Idle, Forward, PreBackward };

struct PendingGather;    // an all-gather in flight (param_group.cpp)
struct PendingReduce;    // a reduce-scatter in flight (reduce.cpp)
struct PostForwardPiece; // what a unit keeps after forward to a smaller group (post_forward.cpp)

struct FSDPParamGroup;

// A reduce-scatter in flight and its unit.
struct InFlightReduce {
  std::shared_ptr<FSDPParamGroup> group;
  std::shared_ptr<PendingReduce> pending;
};

// [Note: per-root context] What the units under one root share, and nothing outside them
// does (FSDP2's FSDPStateContext, with its comm context's post-forward order): two models
// fully sharded in one process, trained alternately or in one backward, keep their own
// orders, reduce-scatters in flight and end-of-backward callback. It lives on the root
// (a unit is a root until fully_shard makes a unit of a module above it).
struct FSDPStateContext {
  // The order in which forward first used the units, this forward's and the last complete
  // one's, and the order in which it last used them (FSDP2's post-forward order), this
  // step ([Note: overlap] in schedule.cpp).
  std::vector<std::weak_ptr<FSDPParamGroup>> pre_order;
  std::vector<std::weak_ptr<FSDPParamGroup>> last_pre_order;
  std::vector<std::weak_ptr<FSDPParamGroup>> post_order;
  bool is_last_backward = true;                 // FSDPModule::set_is_last_backward
  std::shared_ptr<c10::Event> post_optim_event; // until the next forward
  EndOfBackward end_of_backward; // [Note: failed backward] in lib/parallel/end_of_backward.cpp
  std::vector<InFlightReduce> reducing; // oldest first
  size_t carried = 0; // of them, left in flight by an earlier backward ([Note: is_last_backward])
};

// One managed parameter: where its shard sits in the unit's flat shard, and its unsharded
// view in the unit's unsharded buffer.
struct FSDPParam {
  at::Tensor param; // the module's parameter, a DTensor after fully_shard
  std::string fqn;  // its name under the unit's module
  std::vector<int64_t> shape;
  int64_t shard_dim = 0;
  int64_t chunk = 0;      // rows per rank on shard_dim before padding (torch.chunk)
  int64_t row_numel = 0;  // elements per row of shard_dim
  int64_t offset = 0;     // start in the flat shard (elements); its segment holds chunk rows
  int64_t local_rows = 0; // rows this rank holds
  DTensorSpec spec;       // the sharded spec
  // Tensor parallelism: the parameter was a DTensor on a 1-D tp mesh when fully_shard
  // took it; its unsharded value is that DTensor again (tp_spec, with tp_tag), and `shape`
  // above is its local shape. The sharded spec is 2-D over (tp, dp). See [Note: FSDP x TP].
  std::optional<DTensorSpec> tp_spec;
  std::shared_ptr<const TpTag> tp_tag;
  at::Tensor unsharded; // view of the unsharded buffer (param dtype)
  at::Tensor unsharded_grad;
  bool grad_received = false; // in the current backward
  compat::NodePtr grad_node;

  int64_t segment_numel() const { return chunk * row_numel; }
  int64_t rows_on(int64_t shard_rank, int64_t shard_size) const;
  std::vector<int64_t> chunk_shape(int64_t rows) const;
};

// One fully_shard unit: its parameters, the flat shard, the unsharded buffer and the
// collectives that move between them.
struct FSDPParamGroup : std::enable_shared_from_this<FSDPParamGroup> {
  std::weak_ptr<torch::nn::Module> module;               // the (first) module
  std::vector<std::weak_ptr<torch::nn::Module>> modules; // all of a grouped unit's
  std::string name;                                      // the module's name, for messages
  DeviceMesh mesh;
  Group shard_group;
  std::optional<Group> replicate_group; // HSDP
  int64_t shard_size = 1;
  int64_t shard_rank = 0;
  c10::Device device{c10::kCPU};
  FullyShardOptions options;
  std::vector<FSDPParam> params;
  std::weak_ptr<FSDPParamGroup> parent;
  std::shared_ptr<FSDPStateContext> own_context; // used while the unit is a root
  std::vector<std::weak_ptr<FSDPParamGroup>> forward_prefetch;
  std::vector<std::weak_ptr<FSDPParamGroup>> backward_prefetch;

  c10::ScalarType orig_dtype = c10::kFloat;
  c10::ScalarType param_dtype = c10::kFloat;
  c10::ScalarType reduce_dtype = c10::kFloat;
  at::Tensor flat_shard;     // this rank's padded shards, one after another
  int64_t shard_numel = 0;   // its length (equal on every rank)
  at::Tensor unsharded_flat; // every parameter unsharded, one after another
  ShardState state = ShardState::Sharded;
  TrainingState training_state = TrainingState::Idle;
  std::shared_ptr<PendingGather> gather; // while Unsharding
  bool forward_used = false;             // touched by forward since it was last resharded
  bool backward_used = false;            // touched by the current backward
  bool overlap = true;                   // FSDPModule::set_communication_overlap

  std::optional<bool> reshard_after_forward;
  // reshard_after_forward as an int k (1 < k < shard_size): the k ranks that rebuild the
  // unit after forward, and this rank's piece while it is ShardedPostForward.
  int64_t post_forward_size = 0;
  Group post_forward_group;
  std::shared_ptr<PostForwardPiece> post_forward_piece;
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true; // HSDP: [Note: partial reduce output] in reduce.cpp
  bool unshard_in_backward = true;
  // HSDP with requires_all_reduce false: the reduced shards so far, not all-reduced, and
  // which parameters had a gradient in them.
  at::Tensor partial_reduce_output;
  std::vector<bool> partial_received;
  double gradient_divide_factor = 0;                // 0: the data-parallel size
  std::function<void(at::Tensor&)> all_reduce_hook; // FSDPModule::set_all_reduce_hook
  bool force_sum_reduction = false;
  CustomAllGather custom_all_gather;
  CustomReduceScatter custom_reduce_scatter;
  std::optional<std::pair<CommHookState, CommHook>> comm_hook; // register_comm_hook

  bool is_root() const { return parent.expired(); }
  FSDPParamGroup& root();
  // The context of this unit's root ([Note: per-root context]).
  FSDPStateContext& context() { return *root().own_context; }
  const std::shared_ptr<FSDPStateContext>& context_ptr() { return root().own_context; }
  bool is_ancestor_of(const FSDPParamGroup& other) const;
  bool effective_reshard_after_forward() const {
    return reshard_after_forward.value_or(!is_root());
  }

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
  bool gathers_in_place() const; // [Note: all-gather into place] in param_group.cpp
  // Frees the unsharded buffer's storage (views of it, saved by autograd, stay valid and
  // are refilled by the next unshard).
  void reshard();
  // After this unit's forward: reshard(), or with an int reshard_after_forward keep the
  // piece for the smaller group (post_forward.cpp).
  void reshard_after_forward_step();
  void init_post_forward(int64_t k); // validates k; 1 and shard_size mean false and true
  void drop_post_forward_piece();
  at::Tensor take_post_forward_piece();
  int64_t post_forward_bytes() const;
  int64_t unsharded_storage_bytes() const;
  // What the ops of forward and backward use for params[index]: its unsharded view, or
  // for a tensor-parallel parameter a DTensor over it.
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
  // reduce-scatter is left in flight (queued in the registry) and finish_reduce() completes
  // it: when too many are in flight, or at the end of the backward.
  void reduce_grads();
  void finish_reduce(PendingReduce& pending);

 private:
  Work gather_in_place(const at::Tensor& input, bool async);
  FSDPParam plan_param(const std::string& fqn, const at::Tensor& p, const at::Tensor& value,
                       int64_t offset, const std::pair<std::string, at::Tensor>& first) const;
  void set_sharded_spec(FSDPParam& fp, const Placement& shard) const;
  void allocate_buffers();
  at::Tensor local_shard(const FSDPParam& fp) const; // fp's rows of the flat shard
  void bind_params();
  void materialize(const std::vector<at::Tensor>& values);
  // A communication buffer: at::empty, or the custom collective's allocate (checked).
  at::Tensor allocate_comm(int64_t numel, c10::ScalarType dtype, const CommAllocator& allocate,
                           const char* what) const;
  void copy_in_grads(at::Tensor& input) const;
  void start_reduce_flat(PendingReduce& pending); // the reduce-scatter, maybe in flight
  // HSDP's all-reduce, hook, division; false: kept as a partial (requires_all_reduce off).
  bool finish_reduce_flat(PendingReduce& pending);
  at::Tensor reduce_with_hook(at::Tensor& input); // register_comm_hook's path
  void all_reduce_with_hook(at::Tensor& output);  // ... and HSDP's all-reduce on it
  void run_all_reduce_hook(at::Tensor& output) const;
  void accumulate_shard_grads(at::Tensor output, const std::vector<bool>& received);
};

// All live units, in creation order, by module: a lookup table (fsdp_module, find_unit);
// what units share lives in their root's context.
struct FSDPRegistry {
  std::vector<std::pair<std::weak_ptr<torch::nn::Module>, std::shared_ptr<FSDPParamGroup>>> units;
};
FSDPRegistry& fsdp_registry();
std::vector<std::shared_ptr<FSDPParamGroup>> live_units();

// Reduce-scatters in flight at most ([Note: overlap]).
constexpr size_t kMaxReducesInFlight = 1;
// The units whose root is `root`, in creation order.
std::vector<std::shared_ptr<FSDPParamGroup>> units_of_root(const FSDPParamGroup& root);

// Finishes the oldest reduce-scatters of the context until another may go in flight; then
// queue it.
void fsdp_make_room_for_reduce(FSDPStateContext& context);
void fsdp_track_reduce(FSDPStateContext& context, InFlightReduce reduce);
// Finishes every reduce-scatter in flight of the context, oldest first.
void fsdp_finish_reduces(FSDPStateContext& context);

// Called before a unit's unsharded parameters are used: reshards units whose forward is
// over (forward only), unshards this one, runs its prefetches, and in backward queues the
// end-of-backward callback.
void fsdp_before_use(FSDPParamGroup& group, bool in_backward);
// The unit's events on the module seam ([Note: fully_shard on the module seam]).
void fsdp_pre_forward(FSDPParamGroup& group);
void fsdp_post_forward(FSDPParamGroup& group);
void fsdp_pre_backward(FSDPParamGroup& group);
void fsdp_forward_failed(FSDPParamGroup& group);
// Whether the seam's events already unsharded `group` for this forward or backward.
bool fsdp_ready_by_seam(const FSDPParamGroup& group, bool in_backward);

// Queues the end-of-backward callback of `group`'s root, once per backward.
void fsdp_queue_final_callback(FSDPParamGroup& group);

inline std::shared_ptr<const FsdpTag> fsdp_tag(const at::Tensor& t) {
  const DTensorMeta* m = dtensor_meta(t);
  return m != nullptr ? m->extension<FsdpTag>() : nullptr;
}

inline void set_fsdp_tag(const at::Tensor& dtensor, std::shared_ptr<const FsdpTag> tag) {
  mutable_dtensor_meta(dtensor)->set_extension(std::move(tag));
}

} // namespace dtensor::detail
