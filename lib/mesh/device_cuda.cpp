// The device figures of dtensor/device_stats.h that need CUDA's headers; built with
// USE_C10D_NCCL when -Dcuda is enabled, beside backend_nccl.cpp.
#include <dtensor/device_stats.h>

#include <cstdio>
#include <fstream>

#include "internal/check.h"

#ifdef USE_C10D_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

namespace dtensor {

namespace {
void check_gpu(const char* what, c10::Device device) {
  DTENSOR_CHECK(device.is_cuda(),
                "{}: {} is not a GPU: memory snapshots are the CUDA caching "
                "allocator's",
                what, device.str());
}
} // namespace

#ifdef USE_C10D_NCCL

std::string device_name(c10::Device device) {
  return device.is_cuda() ? std::string(at::cuda::getDeviceProperties(device.index())->name)
                          : device.str();
}

DeviceMemoryStats device_memory_stats(c10::Device device) {
  if (!device.is_cuda()) {
    return {};
  }
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  DeviceMemoryStats out;
  out.available = true;
  out.capacity_bytes =
      static_cast<int64_t>(at::cuda::getDeviceProperties(device.index())->totalGlobalMem);
  out.max_active_bytes = stats.active_bytes[all].peak;
  out.max_reserved_bytes = stats.reserved_bytes[all].peak;
  out.num_alloc_retries = stats.num_alloc_retries;
  out.num_ooms = stats.num_ooms;
  return out;
}

void reset_peak_device_memory(c10::Device device) {
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
  }
}

void record_memory_history(c10::Device device, int64_t max_entries) {
  check_gpu("record_memory_history", device);
  DTENSOR_CHECK(max_entries > 0, "record_memory_history: max_entries {} must be > 0", max_entries);
  // Every allocation and free, with its C++ stack (no Python here), as PyTorch's
  // _record_memory_history(enabled="all", context="all", stacks="cpp").
  torch::cuda::_record_memory_history(std::optional<std::string>("all"),
                                      std::optional<std::string>("all"), std::string("cpp"),
                                      static_cast<size_t>(max_entries));
}

void dump_memory_snapshot(c10::Device device, const std::string& path) {
  check_gpu("dump_memory_snapshot", device);
  const std::string pickle = torch::cuda::_memory_snapshot_pickled();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(pickle.data(), static_cast<std::streamsize>(pickle.size()));
    DTENSOR_CHECK(static_cast<bool>(out), "dump_memory_snapshot: cannot write {}", tmp);
  }
  DTENSOR_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0,
                "dump_memory_snapshot: cannot rename {} to {}", tmp, path);
}

#else

std::string device_name(c10::Device device) {
  return device.str();
}

DeviceMemoryStats device_memory_stats(c10::Device) {
  return {};
}

void reset_peak_device_memory(c10::Device) {}

void record_memory_history(c10::Device device, int64_t) {
  check_gpu("record_memory_history", device);
  DTENSOR_FAIL("record_memory_history: dtensor was built without CUDA");
}

void dump_memory_snapshot(c10::Device device, const std::string&) {
  check_gpu("dump_memory_snapshot", device);
  DTENSOR_FAIL("dump_memory_snapshot: dtensor was built without CUDA");
}

#endif

} // namespace dtensor
