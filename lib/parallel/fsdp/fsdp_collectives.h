#pragma once

// fully_shard's collectives, as free functions of a unit (FSDP2's _fsdp_collectives): the
// all-gather of a flat shard and its copy-out, the reduce-scatter of gradients and what
// follows it (HSDP's all-reduce, the hooks, the division). Every one goes through the
// collective choke point (dtensor/collectives.h, mesh/collectives_internal.h).
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/collectives.h>

#include "parallel/fsdp/all_gather_extension.h"
#include "parallel/fsdp/fsdp_param_group.h"
#include "parallel/fsdp/memory.h"
#include "parallel/grad_reduce.h"

namespace dtensor::detail {

// An all-gather in flight: its input is kept alive with the output until it completes
// ([Note: overlap] in fsdp_state.cpp).
struct PendingGather {
  explicit PendingGather(at::Tensor in) : input(std::move(in)) {}
  at::Tensor input;
  std::optional<CommBuffer> buffer; // the gathered shards, to be copied out (not in place)
  // The input is bytes laid out by the unit's all-gather extensions (all_gather_extension.h).
  std::shared_ptr<ExtensionGather> extension;
  Work work;
};

// A reduce-scatter issued and not finished: the buffers it reads and writes live here
// until it completes, with what finishing needs.
struct PendingReduce {
  explicit PendingReduce(at::Tensor in) { input.emplace(std::move(in)); }
  // The unsharded gradients, one rank's part after another; released at issue where the
  // backend copied them ([Note: reduce-scatter input released at issue]).
  std::optional<CommBuffer> input;
  at::Tensor output; // this rank's reduced shard (reduce dtype)
  Work work;         // the reduce-scatter (done already on synchronous paths)
  DivideFactors factors;
  std::vector<bool> received; // which parameters had a gradient
};

// A communication buffer of `group`'s device: at::empty, or the custom collective's
// allocate (checked).
at::Tensor allocate_comm(const FSDPParamGroup& group, int64_t numel, c10::ScalarType dtype,
                         const CommAllocator& allocate, const char* what);

// Starts the all-gather of `pending.input` (a flat shard, or a post-forward piece) over
// `over`, in the background or not. `may_gather_in_place`: the input is the flat shard
// over the shard group, so a synchronous all-gather may fill the unsharded buffer
// directly ([Note: all-gather into place] in fsdp_collectives.cpp).
void all_gather_flat(FSDPParamGroup& group, PendingGather& pending, const Group& over,
                     bool background, bool may_gather_in_place);
// Waits for it and copies every parameter's rows out into the unsharded buffer (nothing
// to copy after a gather into place).
void all_gather_copy_out(FSDPParamGroup& group, PendingGather& pending);

// Starts the reduce-scatter of `pending.input` (every rank's part, filled by the caller):
// the registered communication hook's, a custom one, or the choke point's, left in flight
// with overlap on.
void reduce_scatter_flat(FSDPParamGroup& group, PendingReduce& pending);
// Waits for it; HSDP's all-reduce, the all-reduce hook and the division follow. false:
// the result was kept as a partial ([Note: partial reduce output]), nothing to accumulate.
bool finish_reduce_scatter(FSDPParamGroup& group, PendingReduce& pending);

} // namespace dtensor::detail
