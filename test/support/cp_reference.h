#pragma once

// Context parallelism's judge for the tests (test_context_parallel.cpp, test_cp_methods.cpp):
// plain attention on the whole sequence on one process with an explicit mask (causal, and a
// key of another document masked), k / v heads repeated, autograd for the gradients; the cp
// ranks' results put back in global order to compare with it.
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <dtensor/context_parallel.h>

#include "support/prelude.h"

namespace cp_test {

using dtensor::ContextParallelOptions;
using dtensor::CpLayout;

using Docs = std::vector<std::vector<int64_t>>;

constexpr int64_t kBatch = 2, kHeads = 4, kDim = 8;

inline bool near(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::allclose(a, b, /*rtol=*/1e-5, /*atol=*/2e-6);
}

// Plain attention on the whole sequence, one process: scores with an additive mask (causal,
// and a key of another document masked), kv heads repeated, autograd for the gradients.
struct Reference {
  at::Tensor out, lse, dq, dk, dv;
};

inline at::Tensor mask_of(int64_t seq, bool causal, const Docs& docs, int64_t batch) {
  at::Tensor mask = at::zeros({batch, 1, seq, seq});
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t b = 0; b < batch; ++b) {
    at::Tensor doc = at::zeros({seq}, at::kLong);
    if (!docs.empty()) {
      const auto& row = docs[docs.size() == 1 ? 0 : static_cast<size_t>(b)];
      int64_t at_ = 0;
      for (size_t i = 0; i < row.size(); ++i) {
        doc.narrow(0, at_, row[i]).fill_(static_cast<int64_t>(i));
        at_ += row[i];
      }
    }
    at::Tensor masked = doc.unsqueeze(1) != doc.unsqueeze(0);
    if (causal) {
      masked = masked | at::ones({seq, seq}, at::kBool).triu(1);
    }
    mask[b][0].masked_fill_(masked, -inf);
  }
  return mask;
}

inline Reference reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, bool causal, const Docs& docs) {
  at::Tensor rq = q.detach().requires_grad_(), rk = k.detach().requires_grad_(),
             rv = v.detach().requires_grad_();
  const int64_t rep = q.size(1) / k.size(1);
  at::Tensor scores = at::matmul(rq, rk.repeat_interleave(rep, 1).transpose(-1, -2)) /
                          std::sqrt(static_cast<double>(q.size(-1))) +
                      mask_of(q.size(2), causal, docs, q.size(0));
  at::Tensor out = at::matmul(at::softmax(scores, -1), rv.repeat_interleave(rep, 1));
  (out * g).sum().backward();
  return {out.detach(), at::logsumexp(scores, -1).detach(), rq.grad(), rk.grad(), rv.grad()};
}

struct Inputs {
  at::Tensor q, k, v, g;
};

inline Inputs inputs(int64_t seq, int64_t kv_heads, int seed, int64_t heads = kHeads) {
  at::manual_seed(seed); // the same on every rank
  return {at::rand({kBatch, heads, seq, kDim}), at::rand({kBatch, kv_heads, seq, kDim}),
          at::rand({kBatch, kv_heads, seq, kDim}), at::rand({kBatch, heads, seq, kDim})};
}

// The cp ranks' result put back in global order.
inline Reference run_cp(const Inputs& in, const DeviceMesh& cp_mesh, const CpLayout& layout,
                 const ContextParallelOptions& opts) {
  auto shard = [&](const at::Tensor& t) {
    return dtensor::cp_shard(t, 2, layout, cp_mesh).requires_grad_();
  };
  at::Tensor q = shard(in.q), k = shard(in.k), v = shard(in.v);
  at::Tensor lse;
  at::Tensor out = dtensor::context_parallel_attention(q, k, v, cp_mesh, layout, opts, &lse);
  (out * dtensor::cp_shard(in.g, 2, layout, cp_mesh)).sum().backward();
  auto whole = [&](const at::Tensor& t) {
    return dtensor::cp_unshard(t.detach(), 2, layout, cp_mesh);
  };
  return {whole(out), whole(lse), whole(q.grad()), whole(k.grad()), whole(v.grad())};
}

inline void check_equal(const Reference& got, const Reference& want) {
  CHECK(near(got.out, want.out));
  CHECK(near(got.lse, want.lse));
  CHECK(near(got.dq, want.dq));
  CHECK(near(got.dk, want.dk));
  CHECK(near(got.dv, want.dv));
}

// "all_gather 1, reduce_scatter 1": what a CommDebugMode counted, readable in a failure.
inline std::string counts_text(const std::map<CollectiveKind, int64_t>& counts) {
  std::string out;
  for (const auto& [kind, n] : counts) {
    out += (out.empty() ? "" : ", ") + dtensor::to_string(kind) + " " + std::to_string(n);
  }
  return out;
}

inline DeviceMesh cp_mesh_of_world() {
  return init_device_mesh(device_type(), {world()}, {"cp"});
}

} // namespace cp_test
