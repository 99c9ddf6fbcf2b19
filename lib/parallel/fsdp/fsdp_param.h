#pragma once

// One parameter managed by fully_shard (FSDP2's FSDPParam): where its shard sits in its
// unit's flat shard, its unsharded view, and the moves between the two. The unit
// (fsdp_param_group.h) owns the buffers and the collectives; this owns the per-parameter
// arithmetic on them.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/dtensor_spec.h>

#include "internal/torch_compat.h"
#include "parallel/tp/tensor_parallel.h"
#include "tensor/dtensor_impl.h"

namespace dtensor {
class AllGatherExtension;
} // namespace dtensor

namespace dtensor::detail {

struct FSDPParamGroup;

// What a DTensor is to fully_shard, carried as its FsdpTag extension ([Note: DTensor
// extensions]).
enum class FsdpRole {
  Parameter,           // a managed parameter (sharded); `index` names it in its unit
  UnshardedView,       // a view of a unit's unsharded parameter (its local tensor is the view)
  UnshardedDTensorView // the same for a tensor-parallel parameter (the view is a DTensor)
};

struct FsdpTag {
  std::weak_ptr<FSDPParamGroup> group;
  size_t index = 0;
  FsdpRole role = FsdpRole::Parameter;
  bool is_view() const { return role != FsdpRole::Parameter; }
};

inline std::shared_ptr<const FsdpTag> fsdp_tag(const at::Tensor& t) {
  const DTensorMeta* m = dtensor_meta(t);
  return m != nullptr ? m->extension<FsdpTag>() : nullptr;
}

inline void set_fsdp_tag(const at::Tensor& dtensor, std::shared_ptr<const FsdpTag> tag) {
  mutable_dtensor_meta(dtensor)->set_extension(std::move(tag));
}

// Where a unit shards: the data-parallel mesh, and the shard dim's size and this rank's
// place in it (FSDP2's FSDPMeshInfo).
struct FSDPShardInfo {
  DeviceMesh mesh; // 1-D (FSDP) or 2-D (HSDP: replicate, shard)
  int64_t size = 1;
  int64_t rank = 0;
};

struct FSDPParam {
  at::Tensor param; // the module's parameter, a DTensor after fully_shard
  std::string fqn;  // its name under the unit's module
  std::vector<int64_t> shape;
  int64_t shard_dim = 0;
  int64_t chunk = 0;      // rows per rank on shard_dim before padding (torch.chunk)
  int64_t row_numel = 0;  // elements per row of shard_dim
  int64_t offset = 0;     // start in the flat shard (elements); its segment holds chunk rows
  int64_t local_rows = 0; // rows this rank holds
  DTensorSpec spec;       // the sharded spec
  // Tensor parallelism: the parameter was a DTensor on a 1-D tp mesh when fully_shard
  // took it; its unsharded value is that DTensor again (tp_spec, with tp_tag), and `shape`
  // above is its local shape. The sharded spec is 2-D over (tp, dp). See [Note: FSDP x TP].
  std::optional<DTensorSpec> tp_spec;
  std::shared_ptr<const TpTag> tp_tag;
  at::Tensor unsharded; // view of the unsharded buffer (param dtype)
  // What the unit's all-gather sends for it and how it is rebuilt, when not its values in the
  // parameter dtype ([Note: the all-gather extension] in all_gather_extension.cpp).
  std::shared_ptr<AllGatherExtension> extension;
  // Its extension keeps what was gathered (keeps_gathered): `kept` is the unsharded value, one
  // tensor per tensor sent, and `unsharded` only its shape and dtype, never allocated.
  bool keeps_gathered = false;
  std::vector<at::Tensor> kept;
  at::Tensor unsharded_grad;
  bool grad_received = false; // in the current backward
  compat::NodePtr grad_node;

  // Plans the parameter's segment at `offset` of the flat shard, sharded by `shard` over
  // `info`; `value` is what its shard is cut from (the local tensor of a tp parameter).
  // `unit` names the unit in errors.
  FSDPParam(std::string fqn, const at::Tensor& p, const at::Tensor& value, int64_t offset,
            const Placement& shard, const FSDPShardInfo& info, const std::string& unit);

  int64_t segment_numel() const { return chunk * row_numel; }
  int64_t rows_on(int64_t shard_rank, int64_t shard_size) const;
  std::vector<int64_t> chunk_shape(int64_t rows) const;
  // This rank's rows in `flat` (the flat shard, or a reduced gradient shard).
  at::Tensor local_rows_of(const at::Tensor& flat) const;

  // The parameter becomes, in place, its Shard DTensor over its rows of `flat_shard`,
  // tagged with `tag` (FSDP2's to_sharded).
  void to_sharded(const at::Tensor& flat_shard, std::shared_ptr<FsdpTag> tag);
  // What the ops of forward and backward use: the unsharded view, or for a tensor-parallel
  // parameter a DTensor over it.
  at::Tensor unsharded_value() const { return unsharded_value_of(unsharded); }
  // `value` (in the unsharded view's shape) as the ops see it: a DTensor over it for a
  // tensor-parallel parameter.
  at::Tensor unsharded_value_of(const at::Tensor& value) const;
  // Copies rank r's rows of every rank out of an all-gather's output (each rank's flat
  // shard after the other's, `shard_numel` each) into the unsharded view.
  void copy_out(const at::Tensor& gathered, int64_t shard_numel, int64_t shard_size) const;
  // The other way for gradients: this parameter's segment of each rank's part of a
  // reduce-scatter input, its unsharded gradient's rows then zero padding (all zeros
  // without a gradient).
  void copy_grad_in(at::Tensor& input, int64_t shard_numel, int64_t shard_size) const;
  // A gradient from autograd, in the unsharded parameter's layout, added to unsharded_grad.
  void accumulate_unsharded_grad(const at::Tensor& grad, const std::string& unit);
  // The reduced shard (this parameter's rows of `reduced`, flat) into .grad, a Shard DTensor.
  void accumulate_sharded_grad(const at::Tensor& reduced);

 private:
  void set_sharded_spec(const Placement& shard, const DeviceMesh& mesh, const std::string& unit);
};

} // namespace dtensor::detail
