#pragma once

// Collectives of the choke point (lib/mesh/collectives.cpp) that only the library uses.
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/collectives.h>

namespace dtensor::detail {

// Options for the library's own collectives, whose sizes agree by construction (a DTensor's
// checked global shape, fully_shard's flat buffers, a bucket): no agreement on sizes ([Note:
// agreeing on sizes] in size_check.cpp).
inline CollectiveOptions known_sizes(bool async_op = false) {
  return CollectiveOptions().async_op(async_op).agree_sizes(false);
}

// The exchange behind all_to_all_single, into a given output (token dispatch's buffers).
Work all_to_all_single_into(at::Tensor& output, const at::Tensor& input,
                            const std::vector<int64_t>& out_splits,
                            const std::vector<int64_t>& in_splits, const Group& group,
                            const CollectiveOptions& options = {});

// "Float[4, 2] on cpu": how the choke point names a tensor in its messages.
std::string describe(const at::Tensor& t);

// While one lives on this thread, collectives are not reported to CommDebugMode: the
// library's own bookkeeping (the agreement on sizes), which PyTorch does not issue.
class Uncounted {
 public:
  Uncounted();
  ~Uncounted();
  Uncounted(const Uncounted&) = delete;
  Uncounted& operator=(const Uncounted&) = delete;
  static bool active();
};

// One all-gather of a list of pieces: outputs[r][i] (any strides) receives group rank r's
// inputs[i]; every rank passes pieces of the same shapes and dtype. CommDebugMode records
// one all-gather of the pieces' total size. Gloo only (ProcessGroupGloo's
// allgather_coalesced, which copies each piece straight into its output on Gloo's thread);
// see [Note: all-gather into place] in lib/parallel/fsdp/fsdp_collectives.cpp.
Work all_gather_into_pieces(std::vector<std::vector<at::Tensor>>& outputs,
                            std::vector<at::Tensor>& inputs, const Group& group,
                            const CollectiveOptions& options = {});

// [Note: reduce-scatter input released at issue]
// ProcessGroupGloo's reduce_scatter_tensor clones its input when it is called (it all-reduces
// the clone and copies this rank's chunk out in wait()), in 2.9.1 and 2.15 alike: the caller
// may free the input as soon as the call returns, while the collective is still in flight.
// NCCL reads the input on its stream until the collective completes. True for the first,
// false for the second (and for any other backend). Not for the ops that go as an all-to-all
// on Gloo ([Note: Gloo's reduce-scatter as an all-to-all] in gloo_fast_paths.cpp), which reads the
// input until completion.
bool reduce_scatter_input_free_at_issue(const Group& group, ReduceOp op);

} // namespace dtensor::detail
