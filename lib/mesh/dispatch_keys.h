#pragma once

// [Note: the dispatch keys dtensor occupies]
// c10 keeps a few dispatch keys and device types for backends outside LibTorch; dtensor
// takes three of them, named here and nowhere else:
//  - PrivateUse1 (kDTensorKey): every DTensor carries it; the handler is its fallback and its
//    kernel for the ops with a composite explicit kernel (tensor/dispatch/registration.cpp);
//  - PrivateUse2 (kSelectiveCheckpointKey): on the thread's included keys while selective
//    activation checkpointing records or replays (train/activation_checkpoint/selective.cpp);
//  - MAIA (kSimulatedDevice): the device type of a simulated world's tensors, with its
//    allocator, kernels and fallback (sim/sim_device.cpp).
// Another library that uses one of them (an out-of-tree device renames PrivateUse1 and
// registers kernels and a fallback for it) cannot share a process with dtensor. What dtensor
// finds while it registers (a fallback or kernels already there, an allocator of higher
// priority) is noted, and init_process_group raises it on every rank (check_dispatch_keys),
// naming the key and what holds it, instead of a silent misdispatch later.
#include <string>
#include <vector>

#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>

namespace torch {
class CppFunction;
} // namespace torch

namespace dtensor::detail {

inline constexpr c10::DispatchKey kDTensorKey = c10::DispatchKey::PrivateUse1;
inline constexpr c10::BackendComponent kDTensorBackend = c10::BackendComponent::PrivateUse1Bit;
inline constexpr c10::DispatchKey kSelectiveCheckpointKey = c10::DispatchKey::PrivateUse2;
inline constexpr c10::BackendComponent kSelectiveCheckpointBackend =
    c10::BackendComponent::PrivateUse2Bit;
inline constexpr c10::DeviceType kSimulatedDevice = c10::DeviceType::MAIA;
inline constexpr c10::DispatchKey kSimulatedKey = c10::DispatchKey::MAIA;

// Registers `fallback` as `key`'s fallback kernel for `user` (what dtensor uses the key
// for), unless another library registered one first: that is noted instead.
void register_fallback(c10::DispatchKey key, torch::CppFunction&& fallback, const char* user);

// Notes a conflict found while registering (at load; a message naming key and holder).
void note_dispatch_key_conflict(std::string what);

// The conflicts noted, and PrivateUse1 renamed by another library (checked now).
std::vector<std::string> dispatch_key_conflicts();

// Raises dtensor::Error listing dispatch_key_conflicts(), if any (init_process_group).
void check_dispatch_keys();

} // namespace dtensor::detail
