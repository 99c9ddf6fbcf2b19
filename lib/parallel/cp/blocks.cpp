// The block engine of context parallelism: plan, attention kernel calls, log-sum-exp merge.
#include "parallel/cp/blocks.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "internal/check.h"
#include "mesh/dispatch_keys.h"

namespace dtensor::detail::cp {

// [Note: the block plan]
// A rank's query rows and a source rank's key rows are each cut into segments: the runs of
// consecutive global positions the layout gives them, cut again where a document ends. Both
// come from the same grid (the balancer's chunks and the document boundaries), so two segments
// are either the same positions or disjoint, and the mask over a (query segment, key segment)
// pair is one of three:
//   - empty: another document, or (causal) keys all after the queries: skipped, not computed;
//   - full: the same document and (causal) keys all before the queries;
//   - diagonal: the same positions, causal: the kernel's own is_causal, which is top-left
//     aligned, is then exactly the mask.
// No mask tensor is ever built, and a causal query block's offset in the sequence is this
// classification (the CPU kernel's causal flag cannot express an offset). The pairs are then
// fused into as few kernel calls as the mask allows: query segments that see the same key
// ranges in full share one call per range, and a rank's own rows against its own keys are
// one diagonal call when they lie in one document (its rows are in increasing global order,
// so the top-left causal mask over all of them is the true mask; PyTorch's step 0). Under
// head-tail balancing without documents this gives PyTorch's shapes: one call per source
// rank, all queries against the first half of an earlier rank's keys, or the second half of
// the queries against all of a later rank's keys.

namespace {

struct Segment {
  int64_t local; // first local row
  int64_t start; // first global position
  int64_t length;
  int64_t doc;
};

std::vector<Segment> segments(const CpLayout& layout, int64_t rank,
                              const std::vector<int64_t>& docs) {
  std::vector<int64_t> ends; // document boundaries, increasing
  int64_t acc = 0;
  for (int64_t len : docs) {
    acc += len;
    ends.push_back(acc);
  }
  std::vector<Segment> out;
  int64_t local = 0;
  for (const CpLayout::Run& run : layout.runs(rank)) {
    int64_t pos = run.start;
    const int64_t end = run.start + run.length;
    while (pos < end) {
      int64_t doc = 0;
      int64_t cut = end;
      for (size_t i = 0; i < ends.size(); ++i) {
        if (pos < ends[i]) {
          doc = static_cast<int64_t>(i);
          cut = std::min(end, ends[i]);
          break;
        }
      }
      out.push_back({local + (pos - run.start), pos, cut - pos, doc});
      pos = cut;
    }
    local += run.length;
  }
  return out;
}

enum class Pair { Empty, Full, Diagonal };

Pair classify(const Segment& q, const Segment& k, bool causal) {
  if (q.doc != k.doc) {
    return Pair::Empty;
  }
  if (!causal || k.start + k.length <= q.start) {
    return Pair::Full;
  }
  if (k.start >= q.start + q.length) {
    return Pair::Empty;
  }
  DTENSOR_CHECK(k.start == q.start && k.length == q.length,
                "context_parallel: internal error: key rows [{}, {}) overlap query rows [{}, {}) "
                "in part",
                k.start, k.start + k.length, q.start, q.start + q.length);
  return Pair::Diagonal;
}

struct Range {
  int64_t begin;
  int64_t length;
  bool operator==(const Range& o) const { return begin == o.begin && length == o.length; }
};

// One group of batch rows sharing their documents.
void plan_rows(Plan& plan, const CpLayout& layout, int64_t rank, int64_t src, int64_t b_begin,
               int64_t b_len, const std::vector<int64_t>& docs, bool causal) {
  const std::vector<Segment> qs = segments(layout, rank, docs);
  const std::vector<Segment> ks = segments(layout, src, docs);
  const bool one_doc = docs.size() <= 1 || qs.front().doc == qs.back().doc;
  if (rank == src && one_doc) {
    plan.blocks.push_back({b_begin, b_len, 0, layout.local_len(), 0, layout.local_len(), causal});
    return;
  }
  // Per query segment: the key ranges it sees in full (adjacent segments merged), and its
  // diagonal segment if any.
  std::vector<std::vector<Range>> full(qs.size());
  std::vector<std::optional<Range>> diagonal(qs.size());
  for (size_t i = 0; i < qs.size(); ++i) {
    for (const Segment& k : ks) {
      const Pair p = classify(qs[i], k, causal);
      if (p == Pair::Empty) {
        ++plan.skipped;
      } else if (p == Pair::Diagonal) {
        diagonal[i] = Range{k.local, k.length};
      } else if (!full[i].empty() && full[i].back().begin + full[i].back().length == k.local) {
        full[i].back().length += k.length;
      } else {
        full[i].push_back({k.local, k.length});
      }
    }
  }
  for (size_t i = 0; i < qs.size();) {
    size_t j = i + 1; // query segments i..j-1 see the same keys in full
    while (j < qs.size() && full[j] == full[i] &&
           qs[j].local == qs[j - 1].local + qs[j - 1].length) {
      ++j;
    }
    const int64_t q_len = qs[j - 1].local + qs[j - 1].length - qs[i].local;
    for (const Range& r : full[i]) {
      plan.blocks.push_back({b_begin, b_len, qs[i].local, q_len, r.begin, r.length, false});
    }
    for (size_t m = i; m < j; ++m) {
      if (diagonal[m]) {
        plan.blocks.push_back({b_begin, b_len, qs[m].local, qs[m].length, diagonal[m]->begin,
                               diagonal[m]->length, true});
      }
    }
    i = j;
  }
}

} // namespace

Plan plan_blocks(const CpLayout& layout, int64_t rank, int64_t src, int64_t batch, bool causal) {
  Plan plan;
  const auto& docs = layout.documents();
  if (docs.size() <= 1) {
    plan_rows(plan, layout, rank, src, 0, batch, docs.empty() ? std::vector<int64_t>{} : docs[0],
              causal);
    return plan;
  }
  DTENSOR_CHECK(static_cast<int64_t>(docs.size()) == batch,
                "context_parallel: the layout has documents for {} batch rows but the batch has {} "
                "({})",
                docs.size(), batch, layout.describe());
  for (int64_t b = 0; b < batch;) {
    int64_t e = b + 1;
    while (e < batch && docs[static_cast<size_t>(e)] == docs[static_cast<size_t>(b)]) {
      ++e;
    }
    plan_rows(plan, layout, rank, src, b, e - b, docs[static_cast<size_t>(b)], causal);
    b = e;
  }
  return plan;
}

KernelOut kernel_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                         double scale) {
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, /*dropout_p=*/0.0,
                                                                    causal, std::nullopt, scale);
  return {out, lse};
}

std::vector<at::Tensor> kernel_backward(const at::Tensor& dout, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& out, const at::Tensor& lse, bool causal,
                                        double scale) {
  auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      dout, q, k, v, out, lse, /*dropout_p=*/0.0, causal, std::nullopt, scale);
  return {dq, dk, dv};
}

Accumulator::Accumulator(const at::Tensor& q)
    : out(at::zeros(q.sizes(), q.options().dtype(at::kFloat))),
      lse(at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<double>::infinity(),
                   q.options().dtype(at::kFloat))) {}

namespace {

at::Tensor rows(const at::Tensor& t, const Block& b, bool kv) {
  return t.narrow(0, b.b_begin, b.b_len)
      .narrow(2, kv ? b.kv_begin : b.q_begin, kv ? b.kv_len : b.q_len);
}

// [Note: the merge] out and lse of the rows so far (O, L) and of a new block (o, l):
//   L' = m + log(exp(L - m) + exp(l - m)), m = max(L, l);  O' = exp(L - L') O + exp(l - L') o.
// In fp32 whatever the inputs' dtype (PyTorch's convert_to_f32). A row no block has reached
// holds L = -inf and takes the block's values exactly. The kernel is never run on a row its
// mask empties entirely (it would return lse 0, not -inf, and count a phantom key).
void merge(at::Tensor o_acc, at::Tensor l_acc, const at::Tensor& o, const at::Tensor& l) {
  at::Tensor l32 = l.to(at::kFloat);
  at::Tensor m = at::maximum(l_acc, l32);
  at::Tensor merged = m + at::log(at::exp(l_acc - m) + at::exp(l32 - m));
  o_acc.copy_(at::exp(l_acc - merged).unsqueeze(-1) * o_acc +
              at::exp(l32 - merged).unsqueeze(-1) * o.to(at::kFloat));
  l_acc.copy_(merged);
}

} // namespace

void forward_blocks(Accumulator& acc, const Plan& plan, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, double scale) {
  for (const Block& b : plan.blocks) {
    KernelOut r =
        kernel_forward(rows(q, b, false), rows(k, b, true), rows(v, b, true), b.causal, scale);
    acc.lse_dtype = r.lse.scalar_type();
    merge(rows(acc.out, b, false),
          acc.lse.narrow(0, b.b_begin, b.b_len).narrow(2, b.q_begin, b.q_len), r.out, r.lse);
  }
  stats().kernel_calls += static_cast<int64_t>(plan.blocks.size());
  stats().skipped_blocks += plan.skipped;
}

void check_complete(const Accumulator& acc, const CpLayout& layout) {
  if (acc.lse.device().type() == kSimulatedDevice) {
    return; // a simulated world's tensors have no values to check
  }
  DTENSOR_CHECK(!at::isinf(acc.lse).any().item<bool>(),
                "context_parallel: internal error: query rows no key block reached ({})",
                layout.describe());
}

void backward_blocks(const Plan& plan, const at::Tensor& dout, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                     const at::Tensor& lse, double scale, at::Tensor& dq, at::Tensor& dk,
                     at::Tensor& dv) {
  for (const Block& b : plan.blocks) {
    at::Tensor l = lse.narrow(0, b.b_begin, b.b_len).narrow(2, b.q_begin, b.q_len);
    std::vector<at::Tensor> g =
        kernel_backward(rows(dout, b, false), rows(q, b, false), rows(k, b, true), rows(v, b, true),
                        rows(out, b, false), l, b.causal, scale);
    rows(dq, b, false).add_(g[0]);
    rows(dk, b, true).add_(g[1]);
    rows(dv, b, true).add_(g[2]);
  }
}

double softmax_scale(const at::Tensor& q, const std::optional<double>& scale) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

CpStats& stats() {
  static CpStats s;
  return s;
}

} // namespace dtensor::detail::cp
