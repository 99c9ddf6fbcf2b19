#pragma once

// [Note: device figures] What a training job reports about its device: its name, the memory
// LibTorch's CUDA caching allocator holds (what PyTorch's torch.cuda.memory_stats gives), the
// bytes of live CPU tensors, and the peak dense throughput of known devices, against which
// MFU is measured.
#include <cstdint>
#include <string>

#include <c10/core/Device.h>

namespace dtensor {

// "NVIDIA H100 80GB HBM3" for a CUDA device (in a build with CUDA), "cpu" for the CPU.
std::string device_name(c10::Device device);

// The caching allocator's figures since the last reset_peak_device_memory (or the start).
struct DeviceMemoryStats {
  bool available = false;         // false on the CPU and in a build without CUDA
  int64_t capacity_bytes = 0;     // the device's memory
  int64_t max_active_bytes = 0;   // the peak of the bytes tensors held
  int64_t max_reserved_bytes = 0; // the peak of the bytes the allocator held from the driver
  int64_t num_alloc_retries = 0;  // allocations that had to free cached blocks and retry
  int64_t num_ooms = 0;           // allocations that failed
};
DeviceMemoryStats device_memory_stats(c10::Device device);
void reset_peak_device_memory(c10::Device device);

// PyTorch's memory snapshots of the CUDA caching allocator (torch.cuda.memory.
// _record_memory_history and _dump_snapshot): from now on, the last `max_entries` allocation
// events with their C++ stacks; then the snapshot as the pickle PyTorch's memory viz
// (pytorch.org/memory_viz) reads, written whole to `path`. Both raise dtensor::Error for a
// device that is not a GPU (or in a build without CUDA).
void record_memory_history(c10::Device device, int64_t max_entries);
void dump_memory_snapshot(c10::Device device, const std::string& path);

// The bytes of live CPU tensors (what a CPU job holds in tensors, where the resident set also
// holds the process's code, libraries and the allocator's free lists), counted by a wrapper
// of LibTorch's CPU allocator that count_host_memory() installs (once per process; later
// calls do nothing). Tensors allocated before it are not counted, nor freed from the count.
struct HostMemoryStats {
  bool counting = false;      // false until count_host_memory()
  int64_t live_bytes = 0;     // CPU tensor bytes allocated and not yet freed
  int64_t max_live_bytes = 0; // their peak since the last reset_peak_host_memory
};
void count_host_memory();
HostMemoryStats host_memory_stats();
void reset_peak_host_memory();

// The dense peak TFLOPs, bf16 or fp8, of a device its name identifies (NVIDIA's datasheets:
// A100, H100 SXM / NVL / PCIe, H200, B200, GB200); 0 when the name is none of them (or fp8 on
// a device without fp8).
double peak_tflops(const std::string& device_name, bool fp8);

} // namespace dtensor
