// CpLayout: which global sequence positions each context-parallel rank holds; cp_shard and
// cp_unshard, which move full tensors to that layout and back.
#include <dtensor/context_parallel.h>
#include <dtensor/dtensor.h>

#include <numeric>

#include <ATen/ATen.h>

#include "internal/check.h"

namespace dtensor {

// [Note: load balancing]
// Causal attention makes a query's work grow with its position: with the sequence cut into cp
// consecutive pieces, rank r computes its own triangle plus r full blocks, and the last rank
// waits on (2cp - 1) / cp times the mean (1.75x at cp 4). Head-tail cuts the sequence into 2cp
// chunks and gives rank r chunks r and 2cp-1-r: every rank then has the same causal work (the
// pairs of a front and a back chunk sum to the same), PyTorch's _HeadTailLoadBalancer. With
// packed documents and a document mask, the work is causal inside each document: per-document
// head-tail does the same inside every document (each of its lengths a multiple of 2cp), as
// PyTorch's _PerDocumentHeadTailLoadBalancer. A rank's rows stay in increasing global order in
// every layout, which the block plan relies on ([Note: the block plan] in blocks.cpp).
// Unlike PyTorch, a length the balancer cannot split is an error naming the numbers, never a
// silent fall back to no balancing or a bare assertion.

const char* name_of(CpMethod method) {
  return method == CpMethod::AllGather ? "all-gather" : "ring";
}

const char* name_of(CpBalance balance) {
  switch (balance) {
  case CpBalance::None:
    return "none";
  case CpBalance::HeadTail:
    return "head-tail";
  case CpBalance::PerDocument:
    return "per-document head-tail";
  }
  return "?";
}

namespace {

void check_documents(const std::vector<std::vector<int64_t>>& docs, int64_t seq_len) {
  for (size_t row = 0; row < docs.size(); ++row) {
    int64_t sum = 0;
    for (size_t i = 0; i < docs[row].size(); ++i) {
      DTENSOR_CHECK(docs[row][i] > 0,
                    "context_parallel: document {} of batch row {} has length {} (lengths must be "
                    "positive)",
                    i, row, docs[row][i]);
      sum += docs[row][i];
    }
    DTENSOR_CHECK(sum == seq_len,
                  "context_parallel: the documents of batch row {} ({}) sum to {}, not to the "
                  "sequence length {}",
                  row, fmt::join(docs[row], ", "), sum, seq_len);
  }
}

using Runs = std::vector<CpLayout::Run>;

Runs head_tail(int64_t offset, int64_t length, int64_t cp, int64_t rank) {
  const int64_t c = length / (2 * cp);
  return {{offset + rank * c, c}, {offset + (2 * cp - 1 - rank) * c, c}};
}

} // namespace

CpLayout::CpLayout(int64_t seq_len, int64_t cp, CpBalance balance,
                   std::vector<std::vector<int64_t>> documents)
    : seq_len_(seq_len), cp_(cp), balance_(balance), documents_(std::move(documents)) {
  DTENSOR_CHECK(cp >= 1, "context_parallel: cp must be at least 1, got {}", cp);
  DTENSOR_CHECK(seq_len >= 1, "context_parallel: the sequence length must be positive, got {}",
                seq_len);
  check_documents(documents_, seq_len);
  switch (balance) {
  case CpBalance::None:
    DTENSOR_CHECK(seq_len % cp == 0,
                  "context_parallel: sequence length {} is not divisible by cp = {}", seq_len, cp);
    break;
  case CpBalance::HeadTail:
    DTENSOR_CHECK(seq_len % (2 * cp) == 0,
                  "context_parallel: sequence length {} is not divisible by 2*cp = {} (head-tail "
                  "load balancing)",
                  seq_len, 2 * cp);
    break;
  case CpBalance::PerDocument: {
    DTENSOR_CHECK(!documents_.empty(),
                  "context_parallel: per-document head-tail balancing needs the documents' "
                  "lengths");
    for (size_t row = 1; row < documents_.size(); ++row) {
      DTENSOR_CHECK(documents_[row] == documents_[0],
                    "context_parallel: per-document head-tail balancing needs the same "
                    "documents in every batch row (row 0: {}; row {}: {}); use head-tail with "
                    "per-row documents instead",
                    fmt::join(documents_[0], ", "), row, fmt::join(documents_[row], ", "));
    }
    for (size_t i = 0; i < documents_[0].size(); ++i) {
      DTENSOR_CHECK(documents_[0][i] % (2 * cp) == 0,
                    "context_parallel: document {} has length {}, not a multiple of 2*cp = {} "
                    "(per-document head-tail load balancing)",
                    i, documents_[0][i], 2 * cp);
    }
    break;
  }
  }
  for (int64_t r = 0; r < cp; ++r) {
    Runs runs;
    if (balance == CpBalance::None) {
      runs = {{r * (seq_len / cp), seq_len / cp}};
    } else if (balance == CpBalance::HeadTail) {
      runs = head_tail(0, seq_len, cp, r);
    } else {
      int64_t offset = 0;
      for (int64_t len : documents_[0]) {
        for (const Run& run : head_tail(offset, len, cp, r)) {
          runs.push_back(run);
        }
        offset += len;
      }
    }
    runs_.push_back(std::move(runs));
  }
}

at::Tensor CpLayout::positions(int64_t rank) const {
  std::vector<at::Tensor> parts;
  for (const Run& run : runs(rank)) {
    parts.push_back(at::arange(run.start, run.start + run.length, at::kLong));
  }
  return at::cat(parts);
}

std::string CpLayout::describe() const {
  std::string docs;
  if (!documents_.empty()) {
    docs = fmt::format(", documents {}", documents_.size() == 1 ? fmt::format("{}", documents_[0])
                                                                : fmt::format("{}", documents_));
  }
  return fmt::format("CpLayout(seq_len {}, cp {}, {}{})", seq_len_, cp_, name_of(balance_), docs);
}

namespace {

int64_t checked_dim(const at::Tensor& t, int64_t dim, const CpLayout& layout, const char* what,
                    int64_t expected) {
  const int64_t d = dim < 0 ? dim + t.dim() : dim;
  DTENSOR_CHECK(d >= 0 && d < t.dim(), "{}: dim {} is out of range for a tensor of shape {}", what,
                dim, t.sizes());
  DTENSOR_CHECK(t.size(d) == expected,
                "{}: dim {} of a tensor of shape {} has {} rows, but the layout {} needs {}", what,
                dim, t.sizes(), t.size(d), layout.describe(), expected);
  return d;
}

int64_t cp_rank_of(const DeviceMesh& cp_mesh, const CpLayout& layout, const char* what) {
  DTENSOR_CHECK(cp_mesh.ndim() == 1, "{}: the cp mesh must be 1-D, got {}", what,
                cp_mesh.to_string());
  DTENSOR_CHECK(cp_mesh.size() == layout.cp(), "{}: the cp mesh {} has {} ranks but the layout {}",
                what, cp_mesh.to_string(), cp_mesh.size(), layout.describe());
  return cp_mesh.get_local_rank(0);
}

} // namespace

at::Tensor cp_shard(const at::Tensor& full, int64_t dim, const CpLayout& layout, int64_t rank) {
  const int64_t d = checked_dim(full, dim, layout, "cp_shard", layout.seq_len());
  DTENSOR_CHECK(rank >= 0 && rank < layout.cp(), "cp_shard: rank {} is out of range for {}", rank,
                layout.describe());
  std::vector<at::Tensor> parts;
  for (const CpLayout::Run& run : layout.runs(rank)) {
    parts.push_back(full.narrow(d, run.start, run.length));
  }
  return parts.size() == 1 ? parts[0].contiguous() : at::cat(parts, d);
}

at::Tensor cp_shard(const at::Tensor& full, int64_t dim, const CpLayout& layout,
                    const DeviceMesh& cp_mesh) {
  return cp_shard(full, dim, layout, cp_rank_of(cp_mesh, layout, "cp_shard"));
}

at::Tensor cp_unshard(const at::Tensor& local, int64_t dim, const CpLayout& layout,
                      const DeviceMesh& cp_mesh) {
  cp_rank_of(cp_mesh, layout, "cp_unshard");
  const int64_t d = checked_dim(local, dim, layout, "cp_unshard", layout.local_len());
  std::vector<int64_t> shape = local.sizes().vec();
  shape[static_cast<size_t>(d)] = layout.seq_len();
  // Rank-major pieces, then each global position taken from where its rank put it.
  at::Tensor gathered =
      DTensor::from_local(local, cp_mesh, {Placement::shard(d)}, shape).full_tensor();
  std::vector<at::Tensor> order;
  for (int64_t r = 0; r < layout.cp(); ++r) {
    order.push_back(layout.positions(r));
  }
  at::Tensor where = at::argsort(at::cat(order)).to(local.device());
  return gathered.index_select(d, where);
}

} // namespace dtensor
