#pragma once

// fully_shard's memory accounting behind fsdp_memory_stats() (param_group.cpp, reduce.cpp).
#include <atomic>
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace dtensor::detail {

// [Note: memory accounting] Process-wide counts behind fsdp_memory_stats(): bytes of
// unsharded parameters and of communication buffers while they live. Units run on one
// thread at a time (forward, then autograd's thread for this device); atomics anyway.
struct FsdpMemory {
  std::atomic<int64_t> unsharded{0};
  std::atomic<int64_t> comm{0};
  std::atomic<int64_t> peak{0};
  void note_peak();
};
FsdpMemory& fsdp_memory();

// An unsharded buffer's storage, allocated (to its tensor's size, if smaller) or freed in
// place, counted: views of it stay valid across the two.
void allocate_storage(const at::Tensor& t);
void free_storage(const at::Tensor& t);

// A communication buffer, counted while it lives.
struct CommBuffer {
  explicit CommBuffer(at::Tensor t);
  ~CommBuffer();
  CommBuffer(const CommBuffer&) = delete;
  CommBuffer& operator=(const CommBuffer&) = delete;
  at::Tensor tensor;
  int64_t bytes;
};

} // namespace dtensor::detail
