#pragma once

// An end-of-backward callback that survives a failed backward, shared by fully_shard and
// replicate. See [Note: failed backward] in lib/parallel/end_of_backward.cpp.
#include <functional>
#include <memory>

namespace dtensor::detail {

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
