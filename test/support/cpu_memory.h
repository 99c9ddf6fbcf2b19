#pragma once

// Every CPU tensor allocation of this process, counted: bytes live now and the peak since the
// last reset, and the same for a window: the blocks allocated since mark() (other blocks
// freed meanwhile, e.g. by c10d's threads dropping finished work, do not count there). It wraps the CPU allocator LibTorch had when it was installed, so what it sees
// is what the process allocates for tensors, whoever asks (dtensor, ATen, Gloo's buffers):
// a judge of dtensor's memory that does not take dtensor's word for it.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace dtensor::testing {

class CountingCPUAllocator final : public c10::Allocator {
 public:
  // Installs the counter as LibTorch's CPU allocator (once per process; later calls return
  // it). Tensors allocated before keep their own allocator and are not counted.
  static CountingCPUAllocator& install() {
    static CountingCPUAllocator* counter = [] {
      auto* c = new CountingCPUAllocator(c10::GetCPUAllocator());
      c10::SetCPUAllocator(c, /*priority=*/100);
      return c;
    }();
    return *counter;
  }

  // The data pointer is its own context (ATen's raw_allocate needs that); what frees it is
  // looked up by address.
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (n == 0 || data == nullptr) {
      return inner;
    }
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.emplace(data, Block{std::move(inner), static_cast<int64_t>(n), window_});
      window_live_ += static_cast<int64_t>(n);
      window_peak_ = std::max(window_peak_, window_live_);
    }
    const int64_t now = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

  // Opens a window: from now, window_live() / window_peak() count only new blocks.
  void mark() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++window_;
    window_live_ = 0;
    window_peak_ = 0;
  }
  int64_t window_live() {
    std::lock_guard<std::mutex> lock(mutex_);
    return window_live_;
  }
  int64_t window_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    return window_peak_;
  }

 private:
  struct Block {
    c10::DataPtr inner;
    int64_t bytes;
    int64_t window;
  };
  explicit CountingCPUAllocator(c10::Allocator* base) : base_(base) {}
  static void release(void* data) {
    CountingCPUAllocator& self = install();
    c10::DataPtr inner; // freed through the wrapped allocator when it goes
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.blocks_.find(data);
      if (it == self.blocks_.end()) {
        // Raw memory from the wrapped allocator before the counter came (oneDNN keeps some)
        // and freed through the raw deleter now in place.
        self.base_->raw_deleter()(data);
        return;
      }
      self.live_.fetch_sub(it->second.bytes);
      if (it->second.window == self.window_) {
        self.window_live_ -= it->second.bytes;
      }
      inner = std::move(it->second.inner);
      self.blocks_.erase(it);
    }
  }

  c10::Allocator* base_;
  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
  int64_t window_ = 0;
  int64_t window_live_ = 0;
  int64_t window_peak_ = 0;
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

} // namespace dtensor::testing
