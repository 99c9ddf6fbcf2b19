// The meta device's allocator, counting ([Note: meta memory] in dtensor/simulate.h).
#include <dtensor/simulate.h>

#include <atomic>

#include <c10/core/Allocator.h>

#include "tensor/dispatch/handler.h"

namespace dtensor {

namespace {

// [Note: counting meta allocator]
// ATen allocates every meta tensor's storage through the meta device's registered allocator
// (a null pointer of the right size). This one, registered with a higher priority at load,
// returns the same null pointer but keeps the size in the deleter's context, so the bytes
// alive and their peak are exact for whatever runs on meta: a simulated rank's parameters,
// gradients, optimizer state, activations and communication buffers. The handler's own
// shape inference on global shapes ([Note: shape inference on meta]) is left out: no rank
// holds those tensors. Storages resized in place (out= ops on meta) change their size
// without the allocator and are not seen; the functional ops of a training step allocate.
std::atomic<int64_t> live{0};
std::atomic<int64_t> peak{0};

struct Counted {
  int64_t bytes;
};

void release(void* ctx) {
  auto* c = static_cast<Counted*>(ctx);
  live.fetch_sub(c->bytes, std::memory_order_relaxed);
  delete c;
}

class CountingMetaAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0 || detail::in_shape_inference()) {
      return {nullptr, nullptr, nullptr, c10::Device(c10::kMeta)};
    }
    const auto bytes = static_cast<int64_t>(n);
    const int64_t now = live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
    return {nullptr, new Counted{bytes}, &release, c10::Device(c10::kMeta)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* /*dest*/, const void* /*src*/, size_t /*count*/) const override {}
};

CountingMetaAllocator counting;

// Above ATen's own meta allocator (registered with priority 0).
const bool registered = [] {
  c10::SetAllocator(c10::DeviceType::Meta, &counting, /*priority=*/1);
  return true;
}();

} // namespace

MetaMemoryStats meta_memory_stats() {
  (void)registered;
  return {live.load(std::memory_order_relaxed), peak.load(std::memory_order_relaxed)};
}

void reset_meta_peak_memory() {
  peak.store(live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

} // namespace dtensor
