#pragma once

// An end-of-backward callback that survives a failed backward, shared by fully_shard and
// replicate. See [Note: failed backward] in lib/parallel/end_of_backward.cpp.
#include <functional>
#include <memory>
#include <vector>

namespace dtensor::detail {

// [Note: nested backward] Activation checkpointing runs a backward inside a backward (the
// recompute's graph, lib/train/activation_checkpoint/). A callback queued there would go to
// the inner graph task and run when the inner backward ends, finishing the step's
// reductions half way. While a NestedBackwardScope lives on the thread, EndOfBackward
// keeps the callback instead, and the scope's end (back in the outer backward) queues it on
// the outer graph task.
class NestedBackwardScope {
 public:
  NestedBackwardScope();
  ~NestedBackwardScope();
  NestedBackwardScope(const NestedBackwardScope&) = delete;
  NestedBackwardScope& operator=(const NestedBackwardScope&) = delete;
  // The innermost scope on this thread, or nullptr.
  static NestedBackwardScope* current();
  void defer(std::function<void()> callback) { deferred_.push_back(std::move(callback)); }

 private:
  NestedBackwardScope* outer_;
  std::vector<std::function<void()>> deferred_;
};

class EndOfBackward {
 public:
  // In a backward: queues `callback` as its final callback, unless a live backward has it
  // queued already. When the backward that queued it last died without running it,
  // `after_failure` runs first. Returns whether it was queued now.
  bool queue(const std::function<void()>& after_failure, std::function<void()> callback);
  // The callback calls this when it runs.
  void ran() { ran_ = true; }

 private:
  std::weak_ptr<void> token_; // alive while the backward that queued the callback is
  bool ran_ = true;
};

} // namespace dtensor::detail
