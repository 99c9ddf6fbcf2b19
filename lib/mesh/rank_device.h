#pragma once

#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace dtensor::detail {

// This rank's device of a type: cuda:(LOCAL_RANK % device count) for cuda (where its NCCL
// groups run; [Note: the launch environment] in lib/mesh/launch_env.h), the
// CPU for cpu, the type's device 0 otherwise (the simulated device). Defined, with the
// function below, in lib/mesh/process_group.cpp.
c10::Device rank_device(c10::DeviceType type);

// [Note: tensors follow the mesh's device]
// As PyTorch's from_local and distribute_tensor, and FSDP2's _move_states_to_device for
// fully_shard (replicate does the same): a tensor on another device type than its mesh's (a
// CPU tensor given for a cuda mesh) is copied to this rank's device of the mesh's type
// (its cuda device); meta tensors stay meta. Between the host and GPUs only: for another
// mesh device (the simulated one) a tensor elsewhere is an error, "`what`: tensor on ... but
// the mesh is `mesh`".
at::Tensor to_rank_device(const at::Tensor& t, c10::DeviceType mesh_type, const std::string& what,
                          const std::string& mesh);

// An NCCL world: makes cuda:`index` (LOCAL_RANK % device count) this process's current device
// (as a torchrun program's torch.cuda.set_device(LOCAL_RANK)) and initializes the CUDA runtime
// and LibTorch's CUDA state on it, before init_process_group registers its exit handler
// ([Note: communicators shut down before exit]). Defined in lib/mesh/backend_nccl.cpp;
// nothing without NCCL.
void bind_rank_device(int index);

} // namespace dtensor::detail
