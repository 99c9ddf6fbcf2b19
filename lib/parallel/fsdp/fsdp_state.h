#pragma once

// A fully_shard unit (FSDP2's FSDPState): its place in the unit tree, its root's context,
// its training state and its four events, and the param group it drives
// (fsdp_param_group.h). See docs/fsdp.md and docs/architecture.md "fully_shard".
#include <memory>
#include <vector>

#include <c10/core/Event.h>

#include "parallel/end_of_backward.h"
#include "parallel/fsdp/fsdp_param_group.h"

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor::detail {

// FSDP2's TrainingState, for units called through the module seam ([Note: fully_shard on the
// module seam] in fsdp_state.cpp): Forward between its pre- and post-forward hooks,
// PreBackward from its pre-backward hook to the end of backward, Idle otherwise (always,
// for a unit driven by its ops only).
enum class TrainingState { Idle, Forward, PreBackward };

// A reduce-scatter in flight and its unit.
struct InFlightReduce {
  std::shared_ptr<FSDPParamGroup> group;
  std::shared_ptr<PendingReduce> pending;
};

// Reduce-scatters in flight at most ([Note: overlap]).
constexpr size_t kMaxReducesInFlight = 1;

// [Note: per-root context] What the units under one root share, and nothing outside them
// does (FSDP2's FSDPStateContext, with its comm context's post-forward order): two models
// fully sharded in one process, trained alternately or in one backward, keep their own
// orders, reduce-scatters in flight and end-of-backward callback. It lives on the root
// (a unit is a root until fully_shard makes a unit of a module above it).
struct FSDPStateContext {
  // The order in which forward first used the units, this forward's and the last complete
  // one's, and the order in which it last used them (FSDP2's post-forward order), this
  // step ([Note: overlap] in fsdp_state.cpp).
  std::vector<std::weak_ptr<FSDPState>> pre_order;
  std::vector<std::weak_ptr<FSDPState>> last_pre_order;
  std::vector<std::weak_ptr<FSDPState>> post_order;
  bool is_last_backward = true;                 // FSDPModule::set_is_last_backward
  std::shared_ptr<c10::Event> post_optim_event; // until the next forward
  EndOfBackward end_of_backward; // [Note: failed backward] in lib/parallel/end_of_backward.cpp
  std::vector<InFlightReduce> reducing; // oldest first
  size_t carried = 0; // of them, left in flight by an earlier backward ([Note: is_last_backward])

  // Finishes the oldest reduce-scatters until another may go in flight, then queues it.
  void track_reduce(InFlightReduce reduce);
  void make_room_for_reduce();
  void finish_oldest_reduce();
  void finish_reduces(); // every one in flight, oldest first
  void close_forward();  // this forward's order becomes the last one's
};

struct FSDPState : std::enable_shared_from_this<FSDPState> {
  FSDPState() : group(*this) {}

  FSDPParamGroup group;
  std::weak_ptr<torch::nn::Module> module;               // the (first) module
  std::vector<std::weak_ptr<torch::nn::Module>> modules; // all of a grouped unit's
  std::weak_ptr<FSDPState> parent;
  std::shared_ptr<FSDPStateContext> own_context;           // used while the unit is a root
  std::vector<std::weak_ptr<FSDPState>> forward_prefetch;  // set_modules_to_forward_prefetch
  std::vector<std::weak_ptr<FSDPState>> backward_prefetch; // set_modules_to_backward_prefetch
  TrainingState training_state = TrainingState::Idle;

  const std::string& name() const { return group.name; }
  bool is_root() const { return parent.expired(); }
  FSDPState& root();
  bool is_ancestor_of(const FSDPState& other) const;
  // The context of this unit's root ([Note: per-root context]).
  FSDPStateContext& context() { return *root().own_context; }
  bool effective_reshard_after_forward() const {
    return group.reshard_after_forward.value_or(!is_root());
  }

  // The events on the module seam ([Note: fully_shard on the module seam]).
  void pre_forward();
  void post_forward();
  void pre_backward();
  void forward_failed();
  // The fallback trigger ([Note: fully_shard without module hooks] in fsdp_dispatch.cpp):
  // before an op uses the unit's unsharded parameters, unless the seam's events already
  // made them ready for this forward or backward.
  void before_use(bool in_backward);
  bool ready_by_seam(bool in_backward) const;
  // An op of forward or backward is about to use the unit's unsharded parameters: the
  // fallback trigger, unless the seam made them ready.
  void ready_for_use(bool in_backward) {
    if (!ready_by_seam(in_backward)) {
      before_use(in_backward);
    }
  }
  // Queues the end-of-backward callback of this unit's root, once per backward.
  void queue_final_callback();

 private:
  void record_forward_use(bool first_use);
  std::shared_ptr<FSDPState> implicit_target(bool in_backward);
  void prefetch(bool in_backward);
  void reshard_finished_units();
  void wait_for_post_optim_event();
  // Root only: the end-of-backward callback, and its cleanup after a failed backward.
  void end_of_backward();
  void discard_failed_backward();
};

// All live units, in creation order, by module: a lookup table (fsdp_module, find_unit);
// what units share lives in their root's context.
struct FSDPRegistry {
  std::vector<std::pair<std::weak_ptr<torch::nn::Module>, std::shared_ptr<FSDPState>>> units;
};
FSDPRegistry& fsdp_registry();
std::vector<std::shared_ptr<FSDPState>> live_units();
// The units whose root is `root`, in creation order.
std::vector<std::shared_ptr<FSDPState>> units_of_root(const FSDPState& root);

} // namespace dtensor::detail
