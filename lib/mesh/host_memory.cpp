// The host memory counter of dtensor/device_stats.h ([Note: device figures]).
#include <dtensor/device_stats.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace dtensor {

namespace {

// [Note: counting host memory] A wrapper of the CPU allocator LibTorch had when it was
// installed: each block is allocated by that allocator, its size kept by address until it is
// freed. The data pointer is its own context, as ATen's raw_allocate requires; the deleter
// finds the block by address (a block the wrapper did not allocate, raw memory taken from the
// wrapped allocator before, goes back to it). A lock and a hash-map entry per CPU allocation:
// no cost a step of CPU training notices; a GPU job counts only its few host tensors.
class HostCounter final : public c10::Allocator {
 public:
  static HostCounter* get(bool install) {
    static std::atomic<HostCounter*> installed{nullptr};
    static std::once_flag once;
    if (install) {
      std::call_once(once, [] {
        auto* c = new HostCounter(c10::GetCPUAllocator()); // lives as long as the process
        c10::SetCPUAllocator(c, /*priority=*/100);
        installed = c;
      });
    }
    return installed.load();
  }

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (n == 0 || data == nullptr) {
      return inner;
    }
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.emplace(data, Block{std::move(inner), static_cast<int64_t>(n)});
      live_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, live_);
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  HostMemoryStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {true, live_, peak_};
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = live_;
  }

 private:
  struct Block {
    c10::DataPtr inner;
    int64_t bytes;
  };
  explicit HostCounter(c10::Allocator* base) : base_(base) {}

  static void release(void* data) {
    HostCounter& self = *get(false);
    c10::DataPtr inner; // freed through the wrapped allocator when it goes, outside the lock
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.blocks_.find(data);
      if (it == self.blocks_.end()) {
        self.base_->raw_deleter()(data);
        return;
      }
      self.live_ -= it->second.bytes;
      inner = std::move(it->second.inner);
      self.blocks_.erase(it);
    }
  }

  c10::Allocator* base_;
  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
  int64_t live_ = 0;
  int64_t peak_ = 0;
};

} // namespace

void count_host_memory() {
  HostCounter::get(true);
}

HostMemoryStats host_memory_stats() {
  HostCounter* c = HostCounter::get(false);
  return c == nullptr ? HostMemoryStats{} : c->stats();
}

void reset_peak_host_memory() {
  if (HostCounter* c = HostCounter::get(false)) {
    c->reset_peak();
  }
}

} // namespace dtensor
