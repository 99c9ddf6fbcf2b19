#pragma once

// The collectives of dtensor/collectives.h as issued, after (or without) the agreement on
// sizes: lib/mesh's own. Everything else calls the public entry, with
// CollectiveOptions::agree_sizes(false) (detail::known_sizes()) where sizes agree by
// construction. Kept in their own namespace so that no unqualified call elsewhere finds them.
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/collectives.h>

namespace dtensor::detail::unagreed {

Work all_reduce_(at::Tensor& tensor, ReduceOp op, const Group& group,
                 const CollectiveOptions& options = {});
at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op, const Group& group);
Work all_gather_into_tensor(at::Tensor& output, const at::Tensor& input, const Group& group,
                            const CollectiveOptions& options = {});
at::Tensor all_gather_tensor(const at::Tensor& input, int64_t gather_dim, const Group& group);
Work reduce_scatter_tensor_into(at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                const Group& group, const CollectiveOptions& options = {});
at::Tensor reduce_scatter_tensor(const at::Tensor& input, ReduceOp op, int64_t scatter_dim,
                                 const Group& group);
at::Tensor all_to_all_single(const at::Tensor& input, const std::vector<int64_t>& out_splits,
                             const std::vector<int64_t>& in_splits, const Group& group);
Work broadcast_(at::Tensor& tensor, int src, const Group& group,
                const CollectiveOptions& options = {});

} // namespace dtensor::detail::unagreed
