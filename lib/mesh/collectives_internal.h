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

} // namespace dtensor::detail
