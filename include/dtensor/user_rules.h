#pragma once

// Ways in for code dtensor has no rule for, after torch.distributed.tensor.experimental:
// local_map (run a plain function on the local shards) and ImplicitReplication (plain
// tensors mix with DTensors as Replicate). docs/dtensor.md, "User code".
#include <functional>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <dtensor/device_mesh.h>
#include <dtensor/placement.h>

namespace dtensor {

using LocalFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// PyTorch's local_map: the returned function takes DTensors (and plain tensors, passed
// through), checks each DTensor input against in_placements[i] (nullopt: any; an empty list:
// no check), redistributing it there when redistribute_inputs is true and failing with an
// error naming the input and both layouts otherwise, calls `fn` on the local tensors, and
// wraps output i as a DTensor on the inputs' mesh (or `mesh`) with out_placements[i]
// (nullopt: returned as fn gave it). Differentiable both ways (to_local / from_local); no
// collective besides the requested redistributions. Called with no DTensor input, `fn`
// runs on the plain inputs and its outputs are returned unchanged.
struct LocalMapOptions {
  TORCH_ARG(std::vector<std::optional<Placements>>, out_placements);
  TORCH_ARG(std::vector<std::optional<Placements>>, in_placements); // empty: not checked
  TORCH_ARG(std::optional<DeviceMesh>, mesh);                       // default: the inputs'
  TORCH_ARG(bool, redistribute_inputs) = false;
};
LocalFn local_map(LocalFn fn, LocalMapOptions options);

// PyTorch's implicit_replication: while one lives (any thread), a plain tensor argument of
// an op that also has DTensor arguments is taken as a Replicate DTensor on their mesh
// instead of being refused (each rank's plain tensor must then hold the same value: that is
// the caller's promise, not checked). An op that would write into the plain tensor is
// still refused.
class ImplicitReplication {
 public:
  ImplicitReplication();
  ~ImplicitReplication();
  ImplicitReplication(const ImplicitReplication&) = delete;
  ImplicitReplication& operator=(const ImplicitReplication&) = delete;
};
bool implicit_replication_enabled();

} // namespace dtensor
