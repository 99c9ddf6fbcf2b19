// A fully_shard unit's state (fsdp_state.h): its events, and when its collectives are
// issued and waited for: the order in which forward and backward use the units,
// prefetching, and the reduce-scatters in flight.
#include <algorithm>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "internal/check.h"
#include "parallel/fsdp/fsdp_state.h"
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

using UnitList = std::vector<std::weak_ptr<FSDPState>>;

ptrdiff_t position(const UnitList& list, const FSDPState& unit) {
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].lock().get() == &unit) {
      return static_cast<ptrdiff_t>(i);
    }
  }
  return -1;
}

} // namespace

FSDPState& FSDPState::root() {
  FSDPState* s = this;
  for (auto p = parent.lock(); p; p = p->parent.lock()) {
    s = p.get();
  }
  return *s;
}

bool FSDPState::is_ancestor_of(const FSDPState& other) const {
  for (auto p = other.parent.lock(); p; p = p->parent.lock()) {
    if (p.get() == this) {
      return true;
    }
  }
  return false;
}

void FSDPStateContext::close_forward() {
  if (!pre_order.empty()) {
    last_pre_order = std::move(pre_order);
  }
  pre_order.clear();
  post_order.clear();
}

void FSDPState::record_forward_use(bool first_use) {
  FSDPStateContext& ctx = context();
  if (first_use && !ctx.pre_order.empty() && ctx.pre_order.front().lock().get() == this) {
    ctx.close_forward(); // a new forward without a backward in between
  }
  if (ctx.post_order.empty() || ctx.post_order.back().lock().get() != this) {
    const ptrdiff_t at = position(ctx.post_order, *this);
    if (at >= 0) {
      ctx.post_order.erase(ctx.post_order.begin() + at);
    }
    ctx.post_order.push_back(weak_from_this());
  }
  if (first_use) {
    ctx.pre_order.push_back(weak_from_this());
  }
}

// The unit expected after this one: next in the last forward, or previous in this
// forward's post-order for backward.
std::shared_ptr<FSDPState> FSDPState::implicit_target(bool in_backward) {
  const FSDPStateContext& ctx = context();
  const UnitList& list = in_backward ? ctx.post_order : ctx.last_pre_order;
  const ptrdiff_t at = position(list, *this);
  const ptrdiff_t next = in_backward ? at - 1 : at + 1;
  if (at < 0 || next < 0 || next >= static_cast<ptrdiff_t>(list.size())) {
    return nullptr;
  }
  return list[static_cast<size_t>(next)].lock();
}

void FSDPState::prefetch(bool in_backward) {
  const auto& listed = in_backward ? backward_prefetch : forward_prefetch;
  if (!listed.empty()) {
    for (const auto& w : listed) {
      if (auto s = w.lock(); s && (!in_backward || s->group.unshard_in_backward)) {
        s->group.unshard(/*async=*/true);
      }
    }
    return;
  }
  if (!group.overlap) {
    return;
  }
  if (auto s = implicit_target(in_backward); s && s.get() != this) {
    if (in_backward && !s->group.unshard_in_backward) {
      return; // FSDPModule::set_unshard_in_backward(false)
    }
    s->group.unshard(/*async=*/true);
  }
}

// Forward moved on to this unit: units of its root whose forward is over are freed.
void FSDPState::reshard_finished_units() {
  for (auto& other : units_of_root(root())) {
    const FSDPParamGroup& g = other->group;
    if (other.get() != this && g.forward_used && g.state == ShardState::Unsharded &&
        other->training_state != TrainingState::Forward && // inside its call: not over
        other->effective_reshard_after_forward() && !other->is_ancestor_of(*this)) {
      other->group.reshard_after_forward_step();
    }
  }
}

void FSDPStateContext::finish_oldest_reduce() {
  InFlightReduce r = std::move(reducing.front());
  reducing.erase(reducing.begin());
  carried = carried > 0 ? carried - 1 : 0;
  r.group->finish_reduce(*r.pending);
}

void FSDPStateContext::make_room_for_reduce() {
  while (reducing.size() >= kMaxReducesInFlight) {
    finish_oldest_reduce();
  }
}

void FSDPStateContext::track_reduce(InFlightReduce reduce) {
  reducing.push_back(std::move(reduce));
}

void FSDPStateContext::finish_reduces() {
  while (!reducing.empty()) {
    finish_oldest_reduce();
  }
}

// [Note: is_last_backward] FSDPModule::set_is_last_backward(false) on a root: its
// reduce-scatters still in flight at the end of a backward stay in flight (FSDP2 leaves
// the streams unsynchronized); the next reduce that needs room, or the end of a backward
// with it true, completes them. `carried` counts them (the oldest of `reducing`), so that
// a failed backward after one drops only its own.
void FSDPState::end_of_backward() {
  FSDPStateContext& ctx = *own_context;
  ctx.end_of_backward.ran();
  auto units = units_of_root(*this);
  for (auto& s : units) {
    s->group.end_backward();
  }
  if (ctx.is_last_backward) {
    ctx.finish_reduces();
  }
  ctx.carried = ctx.reducing.size();
  for (auto& s : units) {
    s->group.backward_used = false;
    s->training_state = TrainingState::Idle;
    if (s->group.reshard_after_backward) {
      s->group.reshard();
    }
  }
  ctx.close_forward();
}

// After a failed backward ([Note: failed backward] in lib/parallel/end_of_backward.cpp). A pending
// collective's Work is declared after its buffers: destroyed first, it waits for the
// collective before they go (errors are printed, not thrown).
void FSDPState::discard_failed_backward() {
  FSDPStateContext& ctx = *own_context;
  while (ctx.carried > 0) {
    ctx.finish_oldest_reduce(); // from an earlier backward ([Note: is_last_backward])
  }
  ctx.reducing.clear();
  for (auto& s : units_of_root(*this)) {
    s->group.drop_backward_state();
    s->training_state = TrainingState::Idle;
  }
}

void FSDPState::queue_final_callback() {
  // The root, weakly: a model freed with a backward pending has nothing left to finish.
  std::weak_ptr<FSDPState> weak = root().weak_from_this();
  context().end_of_backward.queue(
      [weak] {
        if (auto r = weak.lock()) {
          r->discard_failed_backward();
        }
      },
      [weak] {
        if (auto r = weak.lock()) {
          r->end_of_backward();
        }
      });
}

// FSDPModule::set_post_optim_event: the current stream waits for it before forward's first
// all-gather (collectives run on the current stream), once.
void FSDPState::wait_for_post_optim_event() {
  FSDPStateContext& ctx = context();
  if (!ctx.post_optim_event) {
    return;
  }
  const std::shared_ptr<c10::Event> event = std::move(ctx.post_optim_event);
  ctx.post_optim_event = nullptr;
  if (event->was_marked_for_recording()) { // else there is nothing to wait for
    event->block(c10::impl::getDeviceGuardImpl(event->device_type())->getStream(event->device()));
  }
}

void FSDPState::before_use(bool in_backward) {
  bool first_use = false;
  if (in_backward) {
    DTENSOR_CHECK(group.unshard_in_backward,
                  "fully_shard unit '{}': backward reads its parameters, but the unit was set "
                  "not to unshard in backward (set_unshard_in_backward(false)); only a unit whose "
                  "backward needs no parameter values (an embedding) may skip it",
                  name());
    queue_final_callback();
    first_use = !group.backward_used;
    group.backward_used = true;
  } else {
    wait_for_post_optim_event();
    reshard_finished_units();
    first_use = !group.forward_used;
    group.forward_used = true;
    record_forward_use(first_use);
  }
  group.unshard(); // its own all-gather, or the wait for its prefetch, and the copy-out
  if (first_use) {
    prefetch(in_backward);
  }
}

// [Note: fully_shard on the module seam]
// A unit called through dtensor::call gets FSDP2's events from its hooks on the module seam
// (fully_shard.cpp registers them, order hook_order::kFullyShard):
//  - pre-forward: what the first op of its forward would do (before_use: the post-optim
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

void FSDPState::pre_forward() {
  if (in_backward()) {
    before_use(/*in_backward=*/true); // a forward inside backward: a recompute
    return;
  }
  before_use(/*in_backward=*/false);
  training_state = TrainingState::Forward;
}

void FSDPState::post_forward() {
  if (training_state != TrainingState::Forward) {
    return;
  }
  training_state = TrainingState::Idle;
  record_forward_use(/*first_use=*/false);
  if (effective_reshard_after_forward() && group.state == ShardState::Unsharded) {
    group.reshard_after_forward_step();
  }
}

void FSDPState::pre_backward() {
  if (!group.unshard_in_backward) {
    return; // set_unshard_in_backward(false): its backward reads no parameter
  }
  before_use(/*in_backward=*/true);
  training_state = TrainingState::PreBackward;
}

void FSDPState::forward_failed() {
  training_state = TrainingState::Idle;
}

bool FSDPState::ready_by_seam(bool in_backward) const {
  const TrainingState want = in_backward ? TrainingState::PreBackward : TrainingState::Forward;
  return training_state == want && group.state == ShardState::Unsharded;
}

} // namespace dtensor::detail
