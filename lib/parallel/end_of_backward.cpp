// An end-of-backward callback that survives a failed backward (parallel/end_of_backward.h).
#include "parallel/end_of_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

namespace dtensor::detail {

// [Note: failed backward]
// A backward that throws (a failing op, a failed collective) never runs its final
// callbacks: fully_shard's reduce-scatters stay in flight and its unsharded gradients
// stay pending; replicate's buckets stay half counted. Were they finished by the next
// backward, its gradients would silently include a part of the failed one (after the
// user's zero_grad, too). And a flag "callback queued" would never be reset, so no later
// backward would finish at all. So the callback carries a token, kept by the engine with
// the callback: while the backward that queued it lives, the token does. When it died
// without the callback running, the next backward first cleans up (fully_shard: waits for
// what is in flight and drops it, with every unit's pending gradients and per-backward
// flags; replicate: resets its bucket counts) and starts clean. Unsharded parameters and
// prefetches stay: they are still valid. (Gradient accumulation without sync loses the
// accumulated part too: after a failed backward, restart the step.)
bool EndOfBackward::queue(const std::function<void()>& after_failure,
                          std::function<void()> callback) {
  if (torch::autograd::get_current_graph_task_id() == -1) {
    return false;
  }
  if (!ran_) {
    if (!token_.expired()) {
      return false; // queued by this backward (or one it runs inside)
    }
    after_failure();
  }
  auto token = std::make_shared<int>(0);
  token_ = token;
  ran_ = false;
  std::function<void()> run = [token, callback = std::move(callback)] { callback(); };
  if (NestedBackwardScope* scope = NestedBackwardScope::current()) {
    scope->defer(std::move(run)); // [Note: nested backward] in end_of_backward.h
  } else {
    torch::autograd::Engine::get_default_engine().queue_callback(std::move(run));
  }
  return true;
}

namespace {
thread_local NestedBackwardScope* innermost = nullptr;
} // namespace

NestedBackwardScope::NestedBackwardScope() : outer_(innermost) { innermost = this; }

NestedBackwardScope::~NestedBackwardScope() {
  innermost = outer_;
  for (auto& callback : deferred_) {
    if (outer_ != nullptr) {
      outer_->defer(std::move(callback));
    } else if (torch::autograd::get_current_graph_task_id() != -1) {
      torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
    } // else: no backward to finish (it failed); the dropped token tells the next one
  }
}

NestedBackwardScope* NestedBackwardScope::current() { return innermost; }

} // namespace dtensor::detail
