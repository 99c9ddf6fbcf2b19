#pragma once

// Collectives of the choke point (lib/mesh/collectives.cpp) that only the library uses.
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/collectives.h>

namespace dtensor::detail {

// One all-gather of a list of pieces: outputs[r][i] (any strides) receives group rank r's
// inputs[i]; every rank passes pieces of the same shapes and dtype. CommDebugMode records
// one all-gather of the pieces' total size. Gloo only (ProcessGroupGloo's
// allgather_coalesced, which copies each piece straight into its output on Gloo's thread);
// see [Note: all-gather into place] in lib/parallel/fsdp/param_group.cpp.
Work all_gather_into_pieces(std::vector<std::vector<at::Tensor>>& outputs,
                            std::vector<at::Tensor>& inputs, const Group& group,
                            const CollectiveOptions& options = {});

// [Note: reduce-scatter input released at issue]
// ProcessGroupGloo's reduce_scatter_tensor clones its input when it is called (it all-reduces
// the clone and copies this rank's chunk out in wait()), in 2.9.1 and 2.15 alike: the caller
// may free the input as soon as the call returns, while the collective is still in flight.
// NCCL reads the input on its stream until the collective completes. True for the first,
// false for the second (and for any other backend). Not for the ops that go as an all-to-all
// on Gloo ([Note: Gloo's reduce-scatter as an all-to-all] in collectives.cpp), which reads the
// input until completion.
bool reduce_scatter_input_free_at_issue(const Group& group, ReduceOp op);

} // namespace dtensor::detail
