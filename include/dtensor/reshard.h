#pragma once

// Weights from one layout to another over the network, without a checkpoint in between: the
// trainer's FSDP x TP shards into a generator's TP replicas, on the same ranks or on others of
// the same world. See docs/reshard.md.
#include <cstdint>
#include <optional>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <dtensor/state_dict.h>

namespace dtensor {

struct ReshardOptions {
  // The label of the transfers in errors and in CommDebugMode's point-to-point records.
  TORCH_ARG(std::string, what) = "reshard";
};

// What one rank moved.
struct ReshardStats {
  int64_t bytes_sent = 0;     // to other ranks
  int64_t bytes_received = 0; // from other ranks
  int64_t bytes_local = 0;    // copied from this rank's own source pieces
  int64_t peers = 0;          // ranks this one sent to or received from
};

// Collective over the world. `source`: the tensors this rank holds in the source layout
// (DTensors of any placements but Partial, or plain tensors: whole), by name; a rank outside
// the source layout passes none. `target`: the tensors this rank must fill, allocated in the
// target layout (DTensors or plain), by name; filled in place, cast to their dtype. Every
// target name must be a source name of the same global shape, and the source pieces of a name
// must tile it (each element in one distinct piece, possibly held by several ranks).
// The plan ([Note: the reshard plan] in lib/checkpoint/reshard.cpp): every target piece takes
// each overlap with a source piece from its own rank when it holds that piece, else from one
// holder (the least loaded); one message per (sender, receiver) pair, in the smaller of the
// two dtypes. Every element thus crosses the network at most once per target piece needing it.
// Bad input is the same dtensor::Error on every rank, before anything moves; targets are
// written once every transfer has arrived (a failed peer leaves this rank's targets as they were).
ReshardStats reshard(const StateDict& source, const StateDict& target,
                     const ReshardOptions& options = {});

} // namespace dtensor
