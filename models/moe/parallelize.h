#pragma once

// Expert parallelism and fully_shard for MoE layers, applied from outside the model as
// torchtitan's parallelize does ([Note: models carry no parallelism] in
// models/llama3/model.h). docs/moe.md, "Meshes and fully_shard".
#include <cstdint>
#include <string>
#include <vector>

#include <dtensor/device_mesh.h>
#include <dtensor/expert_parallel.h>
#include <dtensor/fully_shard.h>
#include <dtensor/placement.h>

#include <models/check.h>
#include <models/moe/moe.h>

namespace dtensor::models {

// torchtitan's sparse mesh: the ranks of the dense region (dp_replicate, dp_shard, cp, tp),
// in the same row-major order, as (dp_replicate, efsdp, ep), efsdp = dp_shard x cp x tp / ep:
// expert parallelism borrows its ranks from data, context and tensor parallelism, innermost
// first. `dense` must be a mesh of init_device_mesh over the whole world whose dims, besides
// an optional leading "dp_replicate", are the dense data-parallel ranks; or, under pipeline
// parallelism, a mesh whose root's leading dimension is "pp": then each pipeline stage's ranks
// (the root without pp) are the dense region, and the sparse mesh is made over the world as
// (pp, dp_replicate, efsdp, ep) and returned without pp. Collective.
inline DeviceMesh moe_sparse_mesh(const DeviceMesh& dense, int64_t ep) {
  const DeviceMesh root = dense.root_mesh();
  const bool pipelined = !root.dim_names().empty() && root.dim_names().front() == "pp";
  std::vector<std::string> names = root.dim_names();
  if (pipelined) {
    names.erase(names.begin());
  }
  const DeviceMesh region_mesh = pipelined ? root[names] : dense;
  const std::vector<std::string>& inner = pipelined ? names : dense.dim_names();
  const bool replicated = !inner.empty() && inner.front() == "dp_replicate";
  const int64_t replicas = replicated ? region_mesh.size(0) : 1;
  const int64_t region = region_mesh.size() / replicas;
  DTENSOR_MODEL_CHECK(ep >= 1 && region % ep == 0, "MoE expert parallelism: ep ", ep,
                      " does not divide the dense region's ", region, " ranks (",
                      region_mesh.to_string(), " without dp_replicate): efsdp x ep must cover them");
  if (pipelined) {
    return init_device_mesh(dense.device_type(), {root.size(0), replicas, region / ep, ep},
                            {"pp", "dp_replicate", "efsdp", "ep"})[{"dp_replicate", "efsdp", "ep"}];
  }
  return init_device_mesh(dense.device_type(), {replicas, region / ep, ep},
                          {"dp_replicate", "efsdp", "ep"});
}

// Expert parallelism's degree and its style's options (how rows travel: docs/moe.md). An int
// converts: the degree, with the default (variable) dispatch.
struct MoEParallel {
  MoEParallel(int64_t degree = 1, // NOLINT(google-explicit-constructor): a degree reads as one
              dtensor::ExpertParallelOptions style = {})
      : ep(degree), options(style) {}
  int64_t ep;
  dtensor::ExpertParallelOptions options;
};

// The experts of `moe` over the sparse mesh's "ep" (ExpertParallel, the router's early
// exchange included).
inline void apply_ep(MoE& moe, const DeviceMesh& sparse,
                     const dtensor::ExpertParallelOptions& options = {}) {
  dtensor::ExpertParallel style(options);
  style.apply(*moe->experts, sparse["ep"]);
  style.apply_router(*moe->router, sparse["ep"]);
}

// The experts fully_shard as their own unit over (dp_replicate, efsdp) (HSDP when there are
// replicas), by expert (Shard(0)) or, when efsdp x ep exceeds the experts (a rank would hold
// less than one), by row of each expert (Shard(1)), as torchtitan; their gradients divided
// by the dense data-parallel degree `dp_degree`, as every other gradient of the model.
inline dtensor::FSDPModule fully_shard_experts(MoE& moe, const DeviceMesh& sparse,
                                               dtensor::FullyShardOptions options,
                                               int64_t dp_degree) {
  const int64_t spread = sparse.size(1) * sparse.size(2);
  if (spread > moe->args.num_experts()) {
    options.shard_placement_fn(
        [](const at::Tensor&) -> std::optional<Placement> { return dtensor::Shard(1); });
  }
  options.mesh(sparse.size(0) > 1 ? sparse[{"dp_replicate", "efsdp"}] : sparse["efsdp"]);
  dtensor::FSDPModule unit = dtensor::fully_shard(*moe->experts, options);
  unit.set_gradient_divide_factor(static_cast<double>(dp_degree));
  return unit;
}

} // namespace dtensor::models
