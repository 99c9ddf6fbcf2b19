// The public collectives of dtensor/collectives.h, each the one entry of its collective: the
// sizes their callers pass are agreed across the group before any data moves (unless the
// options say they agree by construction), then the choke point's collective runs
// (collectives.cpp, collective_calls.h).
#include <dtensor/collectives.h>

#include <ATen/ATen.h>

#include "internal/check.h"
#include "mesh/agree.h"
#include "mesh/collective_calls.h"
#include "mesh/collectives_internal.h"

namespace dtensor {

// [Note: agreeing on sizes]
// A collective whose ranks pass tensors of different sizes does not fail cleanly on Gloo:
// its transport thread finds "Received data size doesn't match expected size" and
// terminates the process, and on two ranks (whose exchange sizes are each rank's own guess,
// [Note: two Gloo ranks by split sizes]) a rank can even return garbage. Where the sizes come
// from the caller (these public functions; DTensor::from_local without a shape), every rank
// first all-gathers a small fingerprint of what it sends and expects (detail::agree_on_sizes:
// one all-gather of about 300 bytes per rank, not counted by CommDebugMode) and a mismatch is
// the same error on every rank, naming each rank's tensor, before any data moves. Where the
// sizes are agreed by construction (a DTensor's redistribution, fully_shard's flat buffers,
// replicate's buckets, the norms and found-inf of clipping and scaling) the library passes
// CollectiveOptions::agree_sizes(false) (detail::known_sizes()) and pays nothing. Only Gloo groups
// of two or more ranks check: on NCCL the check would synchronise the host with the stream
// (TORCH_DISTRIBUTED_DEBUG=DETAIL checks there), and the simulated world has no peers to disagree.
// DTENSOR_AGREE_SIZES=0 in the environment turns it off (PyTorch's behaviour): on a 2-core machine
// one agreement costs about 0.1 ms on 2 ranks and 3 ms on 4 oversubscribed ones
// (docs/benchmarks.md).

namespace {

enum CollectiveCode : int64_t {
  kAllReduce = 1,
  kAllGather,
  kAllGatherDim,
  kReduceScatter,
  kReduceScatterDim,
  kAllToAll,
  kBroadcast
};

int64_t shape_hash(const at::Tensor& t) {
  return t.defined() ? detail::shape_fingerprint(t.sizes(), t.scalar_type()) : -1;
}

bool checks_sizes(const Group& group, const CollectiveOptions& options) {
  return options.agree_sizes() && group.defined() && group.backend_type() == BackendType::Gloo &&
         group.size() > 1 && detail::agree_on_sizes_enabled();
}

// The functional forms return the result: they wait.
void check_sync(const char* what, const CollectiveOptions& options) {
  DTENSOR_CHECK(!options.async_op(),
                "{}: the functional form waits for its result; async_op is for the in-place "
                "forms",
                what);
}

// Every kind's fingerprint has 4 + 2 x group size entries, so that ranks calling different
// collectives still gather rows of one length (and disagree on the kind).
void agree(const Group& group, const CollectiveOptions& options, std::vector<int64_t> head,
           const std::string& description, const std::vector<int64_t>& splits = {},
           detail::Consistent consistent = nullptr) {
  if (!checks_sizes(group, options)) {
    return;
  }
  head.resize(4, 0);
  head.insert(head.end(), splits.begin(), splits.end());
  head.resize(4 + 2 * static_cast<size_t>(group.size()), 0);
  // One prefix for every kind: ranks that called different collectives get one message too
  // (each rank's description names its own call).
  detail::agree_on_sizes("collective", head, description, group, consistent);
}

// all_to_all_single: rank r's in_splits[j] rows go to rank j, which expects out_splits[r].
bool splits_match(const at::Tensor& rows) {
  const int64_t n = rows.size(0);
  if (!rows.narrow(1, 0, 2).eq(rows[0].narrow(0, 0, 2)).all().item<bool>()) {
    return false; // another kind, or another row shape / dtype
  }
  // sends[r][j] (rank r to j) must equal receives[j][r] (rank j from r).
  return rows.narrow(1, 4, n).equal(rows.narrow(1, 4 + n, n).t());
}

// The rows each peer sends or receives: the splits given, or equal ones.
std::vector<int64_t> effective(const std::vector<int64_t>& splits, int64_t rows, int64_t n) {
  return splits.empty() ? std::vector<int64_t>(static_cast<size_t>(n), rows / n) : splits;
}

} // namespace

Work all_reduce_(at::Tensor& tensor, ReduceOp op, const Group& group,
                 const CollectiveOptions& options) {
  agree(group, options, {kAllReduce, shape_hash(tensor), static_cast<int64_t>(op)},
        fmt::format("all_reduce({}, {})", to_string(op), detail::describe(tensor)));
  return detail::unagreed::all_reduce_(tensor, op, group, options);
}

at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op, const Group& group,
                      const CollectiveOptions& options) {
  check_sync("all_reduce", options);
  agree(group, options, {kAllReduce, shape_hash(tensor), static_cast<int64_t>(op)},
        fmt::format("all_reduce({}, {})", to_string(op), detail::describe(tensor)));
  return detail::unagreed::all_reduce(tensor, op, group);
}

Work all_gather_into_tensor(at::Tensor& output, const at::Tensor& input, const Group& group,
                            const CollectiveOptions& options) {
  agree(group, options, {kAllGather, shape_hash(input), shape_hash(output)},
        fmt::format("all_gather_into_tensor({}) into {}", detail::describe(input),
                    detail::describe(output)));
  return detail::unagreed::all_gather_into_tensor(output, input, group, options);
}

at::Tensor all_gather_tensor(const at::Tensor& input, int64_t gather_dim, const Group& group,
                             const CollectiveOptions& options) {
  check_sync("all_gather_tensor", options);
  agree(group, options, {kAllGatherDim, shape_hash(input), gather_dim},
        fmt::format("all_gather_tensor({}) along dim {}", detail::describe(input), gather_dim));
  return detail::unagreed::all_gather_tensor(input, gather_dim, group);
}

Work reduce_scatter_tensor_into(at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                const Group& group, const CollectiveOptions& options) {
  agree(group, options,
        {kReduceScatter, shape_hash(input), shape_hash(output), static_cast<int64_t>(op)},
        fmt::format("reduce_scatter_tensor({}, {}) into {}", to_string(op), detail::describe(input),
                    detail::describe(output)));
  return detail::unagreed::reduce_scatter_tensor_into(output, input, op, group, options);
}

at::Tensor reduce_scatter_tensor(const at::Tensor& input, ReduceOp op, int64_t scatter_dim,
                                 const Group& group, const CollectiveOptions& options) {
  check_sync("reduce_scatter_tensor", options);
  agree(group, options,
        {kReduceScatterDim, shape_hash(input), scatter_dim, static_cast<int64_t>(op)},
        fmt::format("reduce_scatter_tensor({}, {}) along dim {}", to_string(op),
                    detail::describe(input), scatter_dim));
  return detail::unagreed::reduce_scatter_tensor(input, op, scatter_dim, group);
}

at::Tensor all_to_all_single(const at::Tensor& input, const std::vector<int64_t>& out_splits,
                             const std::vector<int64_t>& in_splits, const Group& group,
                             const CollectiveOptions& options) {
  check_sync("all_to_all_single", options);
  if (checks_sizes(group, options)) {
    const auto n = static_cast<size_t>(group.size());
    const bool shaped = input.defined() && input.dim() > 0;
    std::vector<int64_t> splits =
        shaped ? effective(in_splits, input.size(0), group.size()) : std::vector<int64_t>{};
    const std::vector<int64_t> out =
        shaped ? effective(out_splits, input.size(0), group.size()) : std::vector<int64_t>{};
    // Splits of the wrong length: a row that matches no other rank's (the local check then
    // names them on every rank that has them).
    const bool valid = splits.size() == n && out.size() == n;
    splits.insert(splits.end(), out.begin(), out.end());
    splits.resize(2 * n, 0);
    const int64_t row = shaped && valid
                            ? detail::shape_fingerprint(input.sizes().slice(1), input.scalar_type())
                            : -2;
    agree(group, options, {kAllToAll, row},
          fmt::format("all_to_all_single({}) sending {} rows, receiving {}",
                      detail::describe(input),
                      fmt::join(splits.begin(), splits.begin() + static_cast<int64_t>(n), "/"),
                      fmt::join(splits.begin() + static_cast<int64_t>(n), splits.end(), "/")),
          splits, splits_match);
  }
  return detail::unagreed::all_to_all_single(input, out_splits, in_splits, group);
}

Work broadcast_(at::Tensor& tensor, int src, const Group& group, const CollectiveOptions& options) {
  agree(group, options, {kBroadcast, shape_hash(tensor), src},
        fmt::format("broadcast(src={}, {})", src, detail::describe(tensor)));
  return detail::unagreed::broadcast_(tensor, src, group, options);
}

} // namespace dtensor
