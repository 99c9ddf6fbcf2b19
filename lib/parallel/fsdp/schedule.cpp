// When fully_shard's collectives are issued and waited for: the order in which forward and
// backward use the units, prefetching, and the reduce-scatters in flight.
#include <algorithm>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "internal/check.h"
#include "parallel/fsdp/fsdp.h"
#include "tensor/dispatch/op_args.h" // in_backward

namespace dtensor::detail {

// [Note: overlap]
// Compute should not stall on a collective it could have started earlier (FSDP2's
// prefetching and its reduce-scatter stream). Without module hooks the schedule is driven
// by the first use of each unit ([Note: fully_shard without module hooks]):
//  - Orders. Forward records the units in the order it first uses them (pre_order) and in
//    the order it last uses them (post_order, FSDP2's post-forward order), on their root
//    unit, so models trained side by side keep their own orders. The end of a
//    backward -- or the first unit of a forward being used again without one, as in
//    evaluation -- closes a forward: its pre_order becomes last_pre_order.
//  - Forward prefetch. When forward first uses a unit, the unit after it in last_pre_order
//    is all-gathered asynchronously: the all-gather runs (on Gloo's threads, NCCL's stream)
//    while this unit computes, and the next unit's first op only waits for it and copies
//    out. A unit that needs its own all-gather (the first forward, a unit without
//    predecessor) completes it before prefetching, which keeps the issue order of
//    collectives and the memory bound below.
//  - Backward prefetch. When backward first uses a unit, the unit before it in post_order
//    (the next one backward needs) is all-gathered the same way.
//  - Explicit lists (set_modules_to_forward_prefetch / _backward_prefetch) replace the
//    implicit target of their unit, in forward or backward.
//  - Reduce-scatters are issued when a unit's gradients are complete and left in flight;
//    HSDP's all-reduce, the hooks, the division and the accumulation into .grad follow
//    when one is finished: the oldest, before a unit would put more than
//    kMaxReducesInFlight in flight, or all, oldest first, in the end-of-backward
//    callback. So .grad holds the reduced values once backward() returns, as before.
// Collective counts are unchanged as long as each forward uses the units the previous one
// did: a prefetched unit that the forward then does not use costs an all-gather it would
// not have had (FSDP2's explicit prefetching has the same trait). Memory: at most the unit
// in use and one prefetched unit are unsharded (or in flight) beyond the units kept
// unsharded (the root, reshard_after_forward false), plus kMaxReducesInFlight
// reduce-scatter buffers; docs/fsdp.md "Memory". One in flight is enough: a unit's
// reduce-scatter has the next unit's whole backward to complete before the next one is
// issued; 2 measured no faster (mlp, d = 64 and 512, 2 ranks) and held one more buffer.
// With overlap off (FSDPModule::set_communication_overlap(false)) every collective is waited
// for where it is issued and only the explicit lists prefetch.

namespace {

using UnitList = std::vector<std::weak_ptr<FSDPParamGroup>>;

ptrdiff_t position(const UnitList& list, const FSDPParamGroup& group) {
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].lock().get() == &group) {
      return static_cast<ptrdiff_t>(i);
    }
  }
  return -1;
}

void close_forward(FSDPStateContext& root) {
  if (!root.pre_order.empty()) {
    root.last_pre_order = std::move(root.pre_order);
  }
  root.pre_order.clear();
  root.post_order.clear();
}

void record_forward_use(FSDPParamGroup& group, bool first_use) {
  FSDPStateContext& root = group.context();
  if (first_use && !root.pre_order.empty() && root.pre_order.front().lock().get() == &group) {
    close_forward(root); // a new forward without a backward in between
  }
  if (root.post_order.empty() || root.post_order.back().lock().get() != &group) {
    const ptrdiff_t at = position(root.post_order, group);
    if (at >= 0) {
      root.post_order.erase(root.post_order.begin() + at);
    }
    root.post_order.push_back(group.weak_from_this());
  }
  if (first_use) {
    root.pre_order.push_back(group.weak_from_this());
  }
}

// The unit expected after `group`: next in the last forward, or previous in this
// forward's post-order for backward.
std::shared_ptr<FSDPParamGroup> implicit_target(FSDPParamGroup& group, bool in_backward) {
  const FSDPStateContext& root = group.context();
  const UnitList& list = in_backward ? root.post_order : root.last_pre_order;
  const ptrdiff_t at = position(list, group);
  const ptrdiff_t next = in_backward ? at - 1 : at + 1;
  if (at < 0 || next < 0 || next >= static_cast<ptrdiff_t>(list.size())) {
    return nullptr;
  }
  return list[static_cast<size_t>(next)].lock();
}

void prefetch(FSDPParamGroup& group, bool in_backward) {
  const auto& listed = in_backward ? group.backward_prefetch : group.forward_prefetch;
  if (!listed.empty()) {
    for (const auto& w : listed) {
      if (auto g = w.lock(); g && (!in_backward || g->unshard_in_backward)) {
        g->unshard(/*async=*/true);
      }
    }
    return;
  }
  if (!group.overlap) {
    return;
  }
  if (auto g = implicit_target(group, in_backward); g && g.get() != &group) {
    if (in_backward && !g->unshard_in_backward) {
      return; // FSDPModule::set_unshard_in_backward(false)
    }
    g->unshard(/*async=*/true);
  }
}

// Forward moved on to `group`: units of its root whose forward is over are freed.
void reshard_finished_units(FSDPParamGroup& group) {
  for (auto& other : units_of_root(group.root())) {
    if (other.get() != &group && other->forward_used && other->state == ShardState::Unsharded &&
        other->training_state != TrainingState::Forward && // inside its call: not over
        other->effective_reshard_after_forward() && !other->is_ancestor_of(group)) {
      other->reshard_after_forward_step();
    }
  }
}

void finish_oldest_reduce(FSDPStateContext& reg) {
  InFlightReduce r = std::move(reg.reducing.front());
  reg.reducing.erase(reg.reducing.begin());
  reg.carried = reg.carried > 0 ? reg.carried - 1 : 0;
  r.group->finish_reduce(*r.pending);
}

// [Note: is_last_backward] FSDPModule::set_is_last_backward(false) on a root: its
// reduce-scatters still in flight at the end of a backward stay in flight (FSDP2 leaves
// the streams unsynchronized); the next reduce that needs room, or the end of a backward
// with it true, completes them. `carried` counts them (the oldest of `reducing`), so that
// a failed backward after one drops only its own.
void end_of_backward(FSDPParamGroup& root) {
  FSDPStateContext& reg = *root.own_context;
  reg.end_of_backward.ran();
  auto units = units_of_root(root);
  for (auto& g : units) {
    g->end_backward();
  }
  if (reg.is_last_backward) {
    fsdp_finish_reduces(reg);
  }
  reg.carried = reg.reducing.size();
  for (auto& g : units) {
    g->backward_used = false;
    g->training_state = TrainingState::Idle;
    if (g->reshard_after_backward) {
      g->reshard();
    }
  }
  close_forward(reg);
}

} // namespace

void fsdp_make_room_for_reduce(FSDPStateContext& reg) {
  while (reg.reducing.size() >= kMaxReducesInFlight) {
    finish_oldest_reduce(reg);
  }
}

void fsdp_track_reduce(FSDPStateContext& context, InFlightReduce reduce) {
  context.reducing.push_back(std::move(reduce));
}

void fsdp_finish_reduces(FSDPStateContext& reg) {
  while (!reg.reducing.empty()) {
    finish_oldest_reduce(reg);
  }
}

namespace {

// After a failed backward ([Note: failed backward] in lib/parallel/end_of_backward.cpp). A pending
// collective's Work is declared after its buffers: destroyed first, it waits for the
// collective before they go (errors are printed, not thrown).
void discard_failed_backward(FSDPParamGroup& root) {
  FSDPStateContext& reg = *root.own_context;
  while (reg.carried > 0) {
    finish_oldest_reduce(reg); // from an earlier backward ([Note: is_last_backward])
  }
  reg.reducing.clear();
  for (auto& g : units_of_root(root)) {
    g->drop_backward_state();
    g->training_state = TrainingState::Idle;
  }
}

} // namespace

void fsdp_queue_final_callback(FSDPParamGroup& group) {
  // The root, weakly: a model freed with a backward pending has nothing left to finish.
  std::weak_ptr<FSDPParamGroup> weak = group.root().weak_from_this();
  group.context().end_of_backward.queue(
      [weak] {
        if (auto root = weak.lock()) {
          discard_failed_backward(*root);
        }
      },
      [weak] {
        if (auto root = weak.lock()) {
          end_of_backward(*root);
        }
      });
}

namespace {

// FSDPModule::set_post_optim_event: the current stream waits for it before forward's first
// all-gather (collectives run on the current stream), once.
void wait_for_post_optim_event(FSDPStateContext& root) {
  if (!root.post_optim_event) {
    return;
  }
  const std::shared_ptr<c10::Event> event = std::move(root.post_optim_event);
  root.post_optim_event = nullptr;
  if (event->was_marked_for_recording()) { // else there is nothing to wait for
    event->block(c10::impl::getDeviceGuardImpl(event->device_type())->getStream(event->device()));
  }
}

} // namespace

void fsdp_before_use(FSDPParamGroup& group, bool in_backward) {
  bool first_use = false;
  if (in_backward) {
    DTENSOR_CHECK(group.unshard_in_backward,
                  "fully_shard unit '{}': backward reads its parameters, but the unit was set "
                  "not to unshard in backward (set_unshard_in_backward(false)); only a unit whose "
                  "backward needs no parameter values (an embedding) may skip it",
                  group.name);
    fsdp_queue_final_callback(group);
    first_use = !group.backward_used;
    group.backward_used = true;
  } else {
    wait_for_post_optim_event(group.context());
    reshard_finished_units(group);
    first_use = !group.forward_used;
    group.forward_used = true;
    record_forward_use(group, first_use);
  }
  group.unshard(); // its own all-gather, or the wait for its prefetch, and the copy-out
  if (first_use) {
    prefetch(group, in_backward);
  }
}

// [Note: fully_shard on the module seam]
// A unit called through dtensor::call gets FSDP2's events from its hooks on the module seam
// (fully_shard.cpp registers them, order hook_order::kFullyShard):
//  - pre-forward: what the first op of its forward would do (fsdp_before_use: the post-optim
//    event, resharding units whose forward is over, the forward order, the unshard and its
//    prefetch), at the module's entry; the unit is then Forward, and its ops skip all of it;
//  - post-forward: the unit moves to the back of the post-forward order (FSDP2's
//    post_forward_order) and reshards after forward now (reshard_after_forward), not when
//    forward next moves to another unit, so the last block of a model is freed at its exit
//    and all-gathered again in backward, as FSDP2 does;
//  - pre-backward: at the first gradient of its outputs, the backward unshard and its
//    prefetch, and the end-of-backward callback; the unit is PreBackward until that
//    callback, and its backward ops skip all of it.
// The ops stay the trigger for everything the seam does not see ([Note: fully_shard without
// module hooks] in fsdp_dispatch.cpp): a unit called as module->forward(...) (an
// nn::Sequential's children), parameters used outside their unit's call, activation
// checkpointing's recompute, a unit grouped over several modules (fully_shard({m1, m2}),
// whose calls are not one call).

void fsdp_pre_forward(FSDPParamGroup& group) {
  if (in_backward()) {
    fsdp_before_use(group, /*in_backward=*/true); // a forward inside backward: a recompute
    return;
  }
  fsdp_before_use(group, /*in_backward=*/false);
  group.training_state = TrainingState::Forward;
}

void fsdp_post_forward(FSDPParamGroup& group) {
  if (group.training_state != TrainingState::Forward) {
    return;
  }
  group.training_state = TrainingState::Idle;
  record_forward_use(group, /*first_use=*/false);
  if (group.effective_reshard_after_forward() && group.state == ShardState::Unsharded) {
    group.reshard_after_forward_step();
  }
}

void fsdp_pre_backward(FSDPParamGroup& group) {
  if (!group.unshard_in_backward) {
    return; // set_unshard_in_backward(false): its backward reads no parameter
  }
  fsdp_before_use(group, /*in_backward=*/true);
  group.training_state = TrainingState::PreBackward;
}

void fsdp_forward_failed(FSDPParamGroup& group) {
  group.training_state = TrainingState::Idle;
}

bool fsdp_ready_by_seam(const FSDPParamGroup& group, bool in_backward) {
  const TrainingState want = in_backward ? TrainingState::PreBackward : TrainingState::Forward;
  return group.training_state == want && group.state == ShardState::Unsharded;
}

} // namespace dtensor::detail
