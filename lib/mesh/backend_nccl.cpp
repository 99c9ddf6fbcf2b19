// Construction of c10d::ProcessGroupNCCL. The only translation unit that sees the NCCL and
// CUDA headers; built with USE_C10D_NCCL when -Dcuda is enabled.
#include "internal/check.h"
#include "mesh/process_group_state.h"
#include "mesh/rank_device.h"

#ifdef USE_C10D_NCCL
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#else
#include <torch/cuda.h>
#endif

namespace dtensor::detail {

#ifdef USE_C10D_NCCL

bool nccl_available() { return true; }

int cuda_device_count() { return static_cast<int>(c10::cuda::device_count()); }

void bind_rank_device(int index) {
  const auto device = static_cast<c10::DeviceIndex>(index);
  c10::cuda::set_device(device);
  // The first allocation initializes the runtime's context and LibTorch's caching allocator;
  // their teardown, registered now, then runs after dtensor's exit handler.
  (void)at::empty({1}, at::TensorOptions().device(c10::kCUDA, device));
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

#else

bool nccl_available() { return false; }

// Devices LibTorch sees: none unless the program loaded libtorch_cuda (a CUDA program beside a
// build without NCCL, which init_process_group warns about).
int cuda_device_count() { return static_cast<int>(torch::cuda::device_count()); }

void bind_rank_device(int) {}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&,
                                                    int rank, int size,
                                                    std::chrono::milliseconds) {
  DTENSOR_FAIL("init_process_group: backend nccl requested (rank {} of {}) but dtensor was "
               "built without CUDA/NCCL; rebuild with -Dcuda=enabled or use backend gloo",
               rank, size);
}

#endif

} // namespace dtensor::detail
