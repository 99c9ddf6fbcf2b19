#pragma once

// How PyTorch prints DTensor things (repr / str in Python), for the views that must read the
// same as PyTorch's: CommDebugMode's tables and JSON dump ([Note: module attribution]).
#include <cstdint>
#include <string>

#include <c10/util/ArrayRef.h>

#include <dtensor/device_mesh.h>
#include <dtensor/placement.h>

namespace dtensor::detail {

std::string torch_repr(const Placements& placements); // "(Shard(dim=0), Replicate())"
std::string torch_repr(const DeviceMesh& mesh);       // "DeviceMesh((dp=2, tp=2), 'cpu', stride=(2, 1))"
std::string torch_size_repr(c10::IntArrayRef shape);  // "torch.Size([4, 16])"

} // namespace dtensor::detail
