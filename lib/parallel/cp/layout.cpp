// CpLayout: which global sequence positions each context-parallel rank holds; cp_shard and
// cp_unshard, which move full tensors to that layout and back.
#include <dtensor/context_parallel.h>
#include <dtensor/dtensor.h>

#include <algorithm>
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
  switch (method) {
  case CpMethod::AllGather:
    return "all-gather";
  case CpMethod::Ring:
    return "ring";
  case CpMethod::Ulysses:
    return "Ulysses";
  case CpMethod::Hierarchical:
    return "hierarchical";
  }
  return "?";
}

const char* name_of(CpBalance balance) {
  switch (balance) {
  case CpBalance::None:
    return "none";
  case CpBalance::HeadTail:
    return "head-tail";
  case CpBalance::PerDocument:
    return "per-document head-tail";
  case CpBalance::Documents:
    return "documents by cost";
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

// [Note: documents of any length]
// Per-document head-tail needs each document's length to be a multiple of 2cp; packed data
// has documents of 137, 2041, 89 and 1 rows, a different set in every batch row. Under a
// document mask a query row's work is the number of keys it sees, its position in its
// document plus one (causal), so the sequence's cost is known row by row. The layout cuts it
// into 2cp·m equal chunks (m up to 8, chunks of at least 2 rows, where the length allows),
// costs each chunk (summed over the batch rows: all rows share one layout), and deals them to
// the ranks in snake order from the dearest: 0, 1, ..., cp-1, cp-1, ..., 0, 0, 1, ... Every
// rank gets 2m chunks, so the same number of rows, and pairs of dear and cheap chunks, the
// greedy bound on imbalance being one chunk's cost. With m = 1 and one document this is
// head-tail's order exactly (the chunks' costs rise with position); with documents no
// length constraint remains. A rank's chunks, in position order, are its runs.
Runs by_cost(int64_t seq_len, int64_t cp, int64_t rank,
             const std::vector<std::vector<int64_t>>& docs) {
  int64_t m = 1;
  for (int64_t c = 8; c > 1; --c) {
    if (seq_len % (2 * cp * c) == 0 && seq_len / (2 * cp * c) >= 2) {
      m = c;
      break;
    }
  }
  const int64_t chunks = 2 * cp * m, size = seq_len / chunks;
  std::vector<double> cost(static_cast<size_t>(chunks), 0.0);
  const std::vector<std::vector<int64_t>> rows =
      docs.empty() ? std::vector<std::vector<int64_t>>{{seq_len}} : docs;
  for (const auto& row : rows) {
    int64_t start = 0;
    for (int64_t len : row) {
      for (int64_t p = start; p < start + len; ++p) {
        cost[static_cast<size_t>(p / size)] += static_cast<double>(p - start + 1);
      }
      start += len;
    }
  }
  std::vector<int64_t> order(static_cast<size_t>(chunks));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return cost[static_cast<size_t>(a)] > cost[static_cast<size_t>(b)];
  });
  std::vector<int64_t> mine;
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t lap = i / cp, at = i % cp;
    if ((lap % 2 == 0 ? at : cp - 1 - at) == rank) {
      mine.push_back(order[static_cast<size_t>(i)]);
    }
  }
  std::sort(mine.begin(), mine.end());
  Runs runs;
  for (int64_t c : mine) {
    if (!runs.empty() && runs.back().start + runs.back().length == c * size) {
      runs.back().length += size;
    } else {
      runs.push_back({c * size, size});
    }
  }
  return runs;
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
  case CpBalance::Documents:
    DTENSOR_CHECK(seq_len % (2 * cp) == 0,
                  "context_parallel: sequence length {} is not divisible by 2*cp = {} (documents "
                  "balanced by cost; the documents' own lengths may be anything)",
                  seq_len, 2 * cp);
    break;
  }
  for (int64_t r = 0; r < cp; ++r) {
    Runs runs;
    if (balance == CpBalance::Documents) {
      runs = by_cost(seq_len, cp, r, documents_);
    } else if (balance == CpBalance::None) {
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

CpLayout CpLayout::grouped(int64_t size) const {
  DTENSOR_CHECK(size >= 1 && cp_ % size == 0,
                "context_parallel: groups of {} ranks do not divide cp = {}", size, cp_);
  CpLayout out = *this;
  out.cp_ = cp_ / size;
  out.runs_.clear();
  for (int64_t g = 0; g < out.cp_; ++g) {
    Runs runs;
    for (int64_t r = g * size; r < (g + 1) * size; ++r) {
      const Runs& mine = runs_[static_cast<size_t>(r)];
      runs.insert(runs.end(), mine.begin(), mine.end());
    }
    std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.start < b.start; });
    Runs merged;
    for (const Run& run : runs) {
      if (!merged.empty() && merged.back().start + merged.back().length == run.start) {
        merged.back().length += run.length;
      } else {
        merged.push_back(run);
      }
    }
    out.runs_.push_back(std::move(merged));
  }
  return out;
}

at::Tensor CpLayout::positions(int64_t rank) const {
  std::vector<at::Tensor> parts;
  for (const Run& run : runs(rank)) {
    parts.push_back(at::arange(run.start, run.start + run.length, at::kLong));
  }
  return at::cat(parts);
}

int64_t CpLayout::work(int64_t rank) const {
  const std::vector<std::vector<int64_t>> rows =
      documents_.empty() ? std::vector<std::vector<int64_t>>{{seq_len_}} : documents_;
  int64_t total = 0;
  for (const auto& row : rows) {
    std::vector<int64_t> starts{0}; // each document's first position, then the row's end
    for (int64_t len : row) {
      starts.push_back(starts.back() + len);
    }
    size_t doc = 0;
    for (const Run& run : runs(rank)) { // runs ascend: the document index only moves forward
      for (int64_t p = run.start; p < run.start + run.length; ++p) {
        while (starts[doc + 1] <= p) {
          ++doc;
        }
        total += p - starts[doc] + 1;
      }
    }
  }
  return total;
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
