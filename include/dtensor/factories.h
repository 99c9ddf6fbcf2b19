#pragma once

// DTensor factories, PyTorch's torch.distributed.tensor.{zeros, ones, empty, full, rand,
// randn}: a DTensor of global shape `size` on `mesh` with `placements` (default: Replicate
// on every mesh dimension) for which each rank allocates only its own shard. `options` give
// the dtype (default float), requires_grad and optionally a device of the mesh's type; no
// communication. rand / randn follow dtensor/random.h: the full tensor is the same for every
// mesh and placement.
#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <dtensor/dtensor.h>

namespace dtensor {

DTensor zeros(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements = {},
              const at::TensorOptions& options = {});
DTensor ones(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements = {},
             const at::TensorOptions& options = {});
DTensor empty(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements = {},
              const at::TensorOptions& options = {});
DTensor full(at::IntArrayRef size, const at::Scalar& fill_value, const DeviceMesh& mesh,
             const Placements& placements = {}, const at::TensorOptions& options = {});
DTensor rand(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements = {},
             const at::TensorOptions& options = {});
DTensor randn(at::IntArrayRef size, const DeviceMesh& mesh, const Placements& placements = {},
              const at::TensorOptions& options = {});

} // namespace dtensor
