#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <dtensor/process_group.h>

#include "mesh/dispatch_keys.h" // kSimulatedDevice: the device of a simulated world's tensors

namespace dtensor {

// What a Group points at: one c10d communicator over a list of global ranks.
struct Group::State {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<int> ranks; // global ranks; index = group rank
  int rank = -1;          // this process's group rank
  BackendType type = BackendType::Gloo;
  c10::DeviceType device = c10::DeviceType::CPU;
  std::chrono::milliseconds timeout{0};
};

} // namespace dtensor

namespace dtensor::detail {

using GroupState = Group::State;

// Backend constructors, one translation unit each so that only they see the Gloo / NCCL
// headers and defines (lib/mesh/backend_gloo.cpp, lib/mesh/backend_nccl.cpp).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);
// ProcessGroupGloo decorated with faster paths for all-gather and reduce-scatter (a group of
// one is returned as it is); lib/mesh/gloo_fast_paths.cpp.
c10::intrusive_ptr<c10d::Backend> with_gloo_fast_paths(c10::intrusive_ptr<c10d::Backend> gloo);
bool has_gloo_fast_paths(const c10d::Backend& backend);
// [Note: the fake backend] in lib/mesh/backend_fake.cpp.
c10::intrusive_ptr<c10d::Backend> make_fake_backend(int rank, int size);
// `backend` wrapped in c10d::ProcessGroupWrapper for TORCH_DISTRIBUTED_DEBUG=DETAIL (see
// [Note: TORCH_DISTRIBUTED_DEBUG=DETAIL] in lib/mesh/backend_gloo.cpp).
c10::intrusive_ptr<c10d::Backend> wrap_for_debug(const c10::intrusive_ptr<c10d::Backend>& backend,
                                                 const c10::intrusive_ptr<c10d::Store>& store,
                                                 int rank, int size,
                                                 std::chrono::milliseconds timeout);
// TORCH_DISTRIBUTED_DEBUG is DETAIL (read once).
bool debug_detail();
// [Note: background groups] A communicator of its own over every rank, on Gloo whatever the
// world's backend, neither cached nor shared with any mesh: for a background thread whose
// collectives must not interleave with the main thread's on the same communicator
// (checkpoint::async_save). Collective: every rank calls it with the same label, in the same
// order relative to other group creations.
Group new_background_group(const std::string& label);
bool nccl_available();   // built with NCCL
int cuda_device_count(); // visible CUDA devices (lib/mesh/backend_nccl.cpp)

} // namespace dtensor::detail
