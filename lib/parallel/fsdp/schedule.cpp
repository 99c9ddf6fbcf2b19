// When fully_shard's collectives are issued and waited for: the order in which forward and
// backward use the units, prefetching, and the reduce-scatters in flight.
#include <algorithm>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "internal/check.h"
#include "parallel/fsdp/fsdp.h"

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

void close_forward(FSDPParamGroup& root) {
  if (!root.pre_order.empty()) {
    root.last_pre_order = std::move(root.pre_order);
  }
  root.pre_order.clear();
  root.post_order.clear();
}

void record_forward_use(FSDPParamGroup& group, bool first_use) {
  FSDPParamGroup& root = group.root();
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
  const FSDPParamGroup& root = group.root();
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

// Forward moved on to `group`: units whose forward is over are freed.
void reshard_finished_units(const FSDPParamGroup& group) {
  for (auto& other : live_units()) {
    if (other.get() != &group && other->forward_used && other->state == ShardState::Unsharded &&
        other->effective_reshard_after_forward() && !other->is_ancestor_of(group)) {
      other->reshard_after_forward_step();
    }
  }
}

void finish_oldest_reduce(FSDPRegistry& reg) {
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
bool waits_at_end(const std::vector<InFlightReduce>& reducing) {
  for (const auto& r : reducing) {
    if (r.group->root().is_last_backward) {
      return true;
    }
  }
  return false;
}

void end_of_backward() {
  FSDPRegistry& reg = fsdp_registry();
  reg.end_of_backward.ran();
  auto units = live_units();
  for (auto& g : units) {
    g->end_backward();
  }
  if (waits_at_end(reg.reducing)) {
    fsdp_finish_reduces();
  }
  reg.carried = reg.reducing.size();
  for (auto& g : units) {
    g->backward_used = false;
    if (g->reshard_after_backward) {
      g->reshard();
    }
    if (g->is_root()) {
      close_forward(*g);
    }
  }
}

} // namespace

void fsdp_make_room_for_reduce() {
  FSDPRegistry& reg = fsdp_registry();
  while (reg.reducing.size() >= kMaxReducesInFlight) {
    finish_oldest_reduce(reg);
  }
}

void fsdp_track_reduce(InFlightReduce reduce) {
  fsdp_registry().reducing.push_back(std::move(reduce));
}

void fsdp_finish_reduces() {
  FSDPRegistry& reg = fsdp_registry();
  while (!reg.reducing.empty()) {
    finish_oldest_reduce(reg);
  }
}

namespace {

// After a failed backward ([Note: failed backward] in lib/parallel/end_of_backward.cpp). A pending
// collective's Work is declared after its buffers: destroyed first, it waits for the
// collective before they go (errors are printed, not thrown).
void discard_failed_backward(FSDPRegistry& reg) {
  while (reg.carried > 0) {
    finish_oldest_reduce(reg); // from an earlier backward ([Note: is_last_backward])
  }
  reg.reducing.clear();
  for (auto& g : live_units()) {
    g->drop_backward_state();
  }
}

} // namespace

void fsdp_queue_final_callback() {
  FSDPRegistry& reg = fsdp_registry();
  reg.end_of_backward.queue([&reg] { discard_failed_backward(reg); }, end_of_backward);
}

namespace {

// FSDPModule::set_post_optim_event: the current stream waits for it before forward's first
// all-gather (collectives run on the current stream), once.
void wait_for_post_optim_event(FSDPParamGroup& root) {
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
    fsdp_queue_final_callback();
    first_use = !group.backward_used;
    group.backward_used = true;
  } else {
    wait_for_post_optim_event(group.root());
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

} // namespace dtensor::detail
