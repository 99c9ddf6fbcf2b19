#pragma once

// The recipe's ParallelDims (torchtitan's ParallelDims): every degree of the job, resolved from
// the flags and keys and checked once against the world, the model and the batch before any
// process group exists (the same error on every rank, naming the flags and keys), and the
// world mesh with every dimension's group made in one place.
#include <cstdint>
#include <string>
#include <vector>

#include <dtensor/device_mesh.h>

#include "llama_flags.h"

namespace dtensor::train {

struct ParallelDims {
  int64_t pp = 1;
  int64_t dp_replicate = 1;
  int64_t dp_shard = 1;
  int64_t cp = 1;
  int64_t tp = 1;
  int64_t ep = 1; // borrows its ranks from dp_shard x cp x tp (no dimension of its own)
  int64_t world = 1;

  bool pp_enabled() const { return pp > 1; }
  bool cp_enabled() const { return cp > 1; }
  // The ranks that load distinct rows of the global batch.
  int64_t dp() const { return dp_replicate * dp_shard; }
  // The world mesh's dimensions, outermost first: pp (when pp > 1), dp_replicate, dp_shard, cp
  // (when cp > 1), tp; and their sizes.
  std::vector<std::string> names() const;
  std::vector<int64_t> shape() const;
  // The world mesh, every dimension's group made now (collective; callers mute Gloo's
  // connection lines around it).
  DeviceMesh build_mesh(c10::DeviceType kind) const;
};

// The degrees from --mesh / the named degrees / the world size with --pp, --cp and --ep,
// checked with --seq, --batch, accumulation and float8 against `world` ranks; sets f.mesh and
// f.accumulation. A usage error naming the flags otherwise. Before any group is made.
ParallelDims resolve_parallel_dims(Flags& f, int64_t world);

// The schedule's microbatches per step (--microbatches, or 2 x pp; 1 without --pp).
int64_t pipeline_microbatches(const Flags& f);

} // namespace dtensor::train
