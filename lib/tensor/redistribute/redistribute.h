#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/collectives.h>
#include <dtensor/dtensor_spec.h>

namespace dtensor::detail {

// One step of a redistribution: the placement of one mesh dimension changes.
struct Transition; // lib/tensor/redistribute/transitions.h

struct TransformStep {
  int64_t mesh_dim = 0;
  Placement src = Placement::replicate();
  Placement dst = Placement::replicate();
  // Shape of the piece this step works on: the global shape cut by the Shard placements of
  // the mesh dimensions before `mesh_dim` (as they are when the step runs).
  std::vector<int64_t> logical_shape;
  int64_t group_size = 1; // size of mesh dimension `mesh_dim`
  const Transition* transition = nullptr; // the registered transition that executes it
  bool communicates = false;
  std::string to_string() const; // "mesh dim 0: Shard(0) -> Replicate() [all_gather]"
};

// [Note: redistribution planning]
// The planner turns (source spec, target placements) into a list of 1-D steps, one mesh
// dimension each (the PaddlePaddle "N-D as 1-D steps" rule). Shards of the same tensor
// dimension nest left to right, so a shard on mesh dimension j only stays valid while no
// mesh dimension i < j changes how that tensor dimension is cut:
//   1. right to left, every Shard(d) whose target is Partial(sum) is zero-filled, and every
//      other Shard(d) whose mesh dimension changes (but to another Shard), or to whose left a
//      mesh dimension changes the sharding of d, is first gathered (Shard -> Replicate);
//   2. left to right, every mesh dimension moves to its target with one transition;
//      changes no single transition covers go through Replicate (e.g. Partial(max) ->
//      Partial(sum), Shard -> Partial(max), uneven Shard(i) -> Shard(j)).
// Plans depend only on the specs (and this rank's coordinate), so they are cached.
std::vector<TransformStep> plan_redistribute(const DTensorSpec& src, const Placements& dst);

// Runs a plan on this rank's local tensor: one collective per communicating step, through
// the collective choke point.
at::Tensor execute_redistribute(const at::Tensor& local, const DTensorSpec& src,
                                const std::vector<TransformStep>& plan);

// Both, returning the new local tensor for `dst` (same mesh, shape and dtype).
at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src, const Placements& dst);

// Number of plans in the cache (for tests and benchmarks).
size_t redistribute_plan_cache_size();
size_t redistribute_plan_cache_bound();

} // namespace dtensor::detail
