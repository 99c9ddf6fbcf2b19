#pragma once

// Context parallelism: attention over a sequence sharded across the ranks of a `cp` mesh
// dimension, after PyTorch's experimental context_parallel and torchtitan's CP, with no global
// state and no patched functions. Mechanism, methods, counts and memory: docs/context_parallel.md.
//
//   CpLayout layout(seq_len, cp_mesh.size(), CpBalance::HeadTail);   // who holds which rows
//   at::Tensor q_local = cp_shard(q_full, /*dim=*/2, layout, cp_mesh);  // inputs, labels, ...
//   at::Tensor out = context_parallel_attention(q, k, v, cp_mesh, layout, options);
//   at::Tensor out_full = cp_unshard(out, 2, layout, cp_mesh);           // one all-gather
//
// or, on a model, the ContextParallel style on its attention kernels' modules (a module whose
// forward is attention(q, k, v), [B, heads, seq, head_dim]).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <dtensor/device_mesh.h>
#include <dtensor/tensor_parallel.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor {

// How K/V reach the queries of other ranks ([Note: two methods] in
// lib/parallel/cp/methods.cpp, [Note: Ulysses] in lib/parallel/cp/head_methods.cpp).
enum class CpMethod {
  // K/V Shard -> Replicate (one all-gather per call), their gradient Partial -> Shard (one
  // reduce-scatter): torchtitan's 2026 design, on dtensor's redistribution.
  AllGather,
  // K/V blocks passed round the ring (cp - 1 exchanges forward, the next block's transfer
  // overlapping this block's kernel), dK/dV passed back round it in backward: O(S/cp) memory.
  Ring,
  // DeepSpeed-Ulysses: one all-to-all gives each rank the whole sequence of 1/cp of the heads,
  // one takes the output back (backward: the mirror); the heads (after tensor parallelism),
  // query and key / value alike, must divide by cp ([Note: Ulysses] in head_methods.cpp).
  Ulysses,
  // Ulysses inside groups of ContextParallelOptions::ulysses_degree consecutive cp ranks (a
  // node), the ring across the groups ("USP"): an all-to-all in the group, the ring over the
  // ranks holding the same heads, an all-to-all back ([Note: hierarchical] in
  // head_methods.cpp).
  Hierarchical,
};

// Which sequence positions each rank holds ([Note: load balancing] in lib/parallel/cp/layout.cpp).
enum class CpBalance {
  None,       // rank r: the r-th of cp equal pieces
  HeadTail,   // rank r: chunks r and 2cp-1-r of 2cp (causal work equal on every rank)
  PerDocument, // HeadTail inside every document of a packed sequence
  // Packed documents of any length (per batch row or shared), balanced by attention cost: the
  // sequence cut into equal chunks, each costed by the keys its rows see under the document
  // mask (summed over the batch rows), dealt to the ranks in snake order from the dearest
  // ([Note: documents of any length] in lib/parallel/cp/layout.cpp). Without documents it is
  // head-tail's order, finer.
  Documents,
};

const char* name_of(CpMethod method);
const char* name_of(CpBalance balance);

// The layout of one step's sequences over `cp` ranks. `documents`: the lengths of the packed
// documents of each batch row, in order, summing to seq_len (one row: the same for every
// row; empty: one document per row). Under a document mask a query sees only keys of its own
// document. Every rank builds the same layout from the same arguments: planning needs no
// communication, and what it refuses it refuses on every rank, naming the numbers.
class CpLayout {
 public:
  CpLayout(int64_t seq_len, int64_t cp, CpBalance balance,
           std::vector<std::vector<int64_t>> documents = {});

  int64_t seq_len() const { return seq_len_; }
  int64_t cp() const { return cp_; }
  int64_t local_len() const { return seq_len_ / cp_; }
  CpBalance balance() const { return balance_; }
  const std::vector<std::vector<int64_t>>& documents() const { return documents_; }
  // The global positions of `rank`'s rows, in its local order, as [start, length) runs
  // (ascending: a rank's rows are always in increasing global order).
  struct Run {
    int64_t start;
    int64_t length;
  };
  const std::vector<Run>& runs(int64_t rank) const { return runs_.at(static_cast<size_t>(rank)); }
  // The layout over groups of `size` consecutive ranks: group g holds the rows of ranks
  // g*size ... g*size+size-1, in global order (the hierarchical method's ring).
  CpLayout grouped(int64_t size) const;
  // The same as an int64 tensor of local_len() positions (positions for rotary embeddings).
  at::Tensor positions(int64_t rank) const;
  // Causal attention's work on `rank`'s rows: the (query, key) pairs its queries attend to under
  // the document mask (a query sees the keys of its document up to its own position), summed
  // over the batch rows (one document per row without documents). Its maximum over the ranks
  // against the mean is what the ranks of a call wait on (the balance).
  int64_t work(int64_t rank) const;
  std::string describe() const;

 private:
  int64_t seq_len_;
  int64_t cp_;
  CpBalance balance_;
  std::vector<std::vector<int64_t>> documents_;
  std::vector<std::vector<Run>> runs_;
};

// The piece of a full (every rank the same) tensor that `rank` holds along `dim`, or this
// process's rank in the 1-D `cp_mesh`. No communication: every rank cuts its own copy.
at::Tensor cp_shard(const at::Tensor& full, int64_t dim, const CpLayout& layout, int64_t rank);
at::Tensor cp_shard(const at::Tensor& full, int64_t dim, const CpLayout& layout,
                    const DeviceMesh& cp_mesh);
// The inverse: every rank's piece along `dim` gathered (one all-gather over `cp_mesh`) and put
// back in global order. Differentiable.
at::Tensor cp_unshard(const at::Tensor& local, int64_t dim, const CpLayout& layout,
                      const DeviceMesh& cp_mesh);

struct ContextParallelOptions {
  TORCH_ARG(CpMethod, method) = CpMethod::AllGather;
  // Hierarchical: the ranks of each all-to-all group (a divisor of cp; cp / it rings).
  TORCH_ARG(int64_t, ulysses_degree) = 0;
  TORCH_ARG(bool, causal) = true;
  // Softmax scale; unset: 1/sqrt(head_dim), as scaled_dot_product_attention.
  TORCH_ARG(std::optional<double>, scale) = std::nullopt;
};

// What the last calls planned and moved (this process, since the last reset_cp_stats()).
struct CpStats {
  int64_t calls = 0;          // attention calls (forward)
  int64_t kernel_calls = 0;   // attention kernel launches, forward
  int64_t skipped_blocks = 0; // (query block, key block) pairs the mask empties: not computed
  int64_t peak_kv_bytes = 0;  // the most K/V bytes (other ranks' included) held at once by a call
};
CpStats cp_stats();
void reset_cp_stats();

// Attention of this rank's queries over the whole sequence's keys and values. q: [B, Hq, L, d],
// k / v: [B, Hkv, L, d] (Hq a multiple of Hkv: grouped-query attention exchanges Hkv heads),
// L = layout.local_len(), the rows in `layout`'s order for this rank of the 1-D `cp_mesh`.
// Returns the output [B, Hq, L, d] in q's dtype; differentiable in q, k and v. With `lse`,
// also the log-sum-exp of each query row's scores, [B, Hq, L], fp32.
at::Tensor context_parallel_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const DeviceMesh& cp_mesh, const CpLayout& layout,
                                      const ContextParallelOptions& options = {},
                                      at::Tensor* lse = nullptr);

// The style on an attention module: a module whose forward(q, k, v) returns attention's output
// ([B, heads, seq, head_dim] each, as context_parallel_attention). Its calls through
// dtensor::call run context_parallel_attention instead, on the layout of the current step
// (set_layout; shared by every module the style was applied to). Inputs that are DTensors on
// another mesh (tensor parallelism's heads) compute on their local heads and come back in
// their placements. A module that is not attention is refused when its call's inputs are not
// three tensors of that form.
class ContextParallel : public ParallelStyle {
 public:
  explicit ContextParallel(ContextParallelOptions options = {});
  std::string name() const override { return "ContextParallel"; }
  bool needs_module_calls() const override { return true; }
  void apply(torch::nn::Module& module, const DeviceMesh& cp_mesh) const override;
  // The layout of the sequences of the next calls (per step: documents change with the batch).
  void set_layout(const CpLayout& layout) const;
  // The layout set last; throws when none was.
  CpLayout layout() const;
  // Off: the modules' own forward runs on whatever each rank holds (every cp rank the whole
  // sequence: generation, evaluation); on again for training. On by default.
  void set_enabled(bool enabled) const;
  bool enabled() const;
  const ContextParallelOptions& options() const;

  struct State; // the options and the current layout (lib/parallel/cp/context_parallel.cpp)

 private:
  std::shared_ptr<State> state_;
};

} // namespace dtensor
