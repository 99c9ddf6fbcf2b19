#pragma once

#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/device_mesh.h>
#include <dtensor/dtensor_spec.h>
#include <dtensor/placement.h>

namespace dtensor {

// [Note: a DTensor is an at::Tensor]
// A DTensor is an ordinary at::Tensor whose dispatch keys carry the PrivateUse1 bit next to
// its local device's backend bit, whose sizes are the global shape, which has no storage,
// and whose TensorImpl's BackendMeta holds the local tensor and the DTensorSpec. Every
// aten op on it reaches dtensor's dispatch handler (below autograd, so autograd records it
// like any op), which runs the op on local tensors after sharding propagation.
// Because the state travels with the TensorImpl's metadata, `param.set_data(dtensor)`,
// `.detach()`, `.data()` and autograd's shallow copies all stay DTensors: modules and
// optimizers keep working on their existing parameter handles.
//
// dtensor::DTensor is a view of such a tensor with the DTensor API; it adds no state and
// converts to at::Tensor implicitly (it derives from it).
class DTensor : public at::Tensor {
 public:
  DTensor() = default;
  // Throws when `t` is not a DTensor.
  explicit DTensor(const at::Tensor& t);

  // Wraps an existing local shard. `shape`/`stride` default to the global shape implied by
  // even shards of `local`; then, on a Gloo mesh of 2+ ranks, the ranks first agree on it (one
  // small all-gather per mesh dimension, not counted by CommDebugMode), so that local tensors
  // that differ between ranks are the same error on every rank here instead of a process
  // aborted by the next collective. With `shape` given there is no communication: the caller
  // vouches for it (PyTorch's from_local(shape=...)), and an uneven layout needs it.
  static DTensor from_local(const at::Tensor& local, const DeviceMesh& mesh,
                            const Placements& placements,
                            std::optional<std::vector<int64_t>> shape = std::nullopt,
                            std::optional<std::vector<int64_t>> stride = std::nullopt);

  // Differentiable: the local tensor's gradient flows back as a DTensor in this DTensor's
  // placements, or in `grad_placements` (PyTorch's to_local(grad_placements=...)). A rank's
  // gradient that is only its share of the whole (each rank used a Replicate tensor's local copy
  // for its own part of the work) is Partial: given so, it is summed over the ranks on its way
  // back (Partial -> Shard: one reduce-scatter) instead of read as the whole gradient.
  at::Tensor to_local(const std::optional<Placements>& grad_placements = std::nullopt) const;
  at::Tensor full_tensor() const; // redistribute to Replicate everywhere, then to_local()
  DTensor redistribute(const DeviceMesh& mesh, const Placements& placements,
                       bool async_op = false) const; // differentiable
  DTensor redistribute(const Placements& placements) const;

  const Placements& placements() const;
  const DeviceMesh& device_mesh() const;
  const DTensorSpec& spec() const;
};

bool is_dtensor(const at::Tensor& t);

// Distributes a full tensor: each rank keeps its piece of `tensor` as held by the source
// rank (one broadcast per mesh dimension, then local chunks for Shard placements).
// `src_data_rank` is PyTorch's: the source's group rank on every mesh dimension, so the
// default 0 is the mesh's own first rank, on any sub-mesh. nullopt: no communication, each
// rank cuts its own `tensor` (which must then be the same on every rank). A meta tensor
// gives a DTensor whose local piece is on the meta device, without communication
// (dtensor::to_empty in dtensor/materialize.h allocates it).
DTensor distribute_tensor(const at::Tensor& tensor, const DeviceMesh& mesh,
                          const Placements& placements, std::optional<int> src_data_rank = 0);

} // namespace dtensor
