#pragma once

// The block engine both context-parallel methods share: which (query rows, key rows) blocks
// of this rank's queries against one source rank's keys and values the mask leaves anything
// in, each computed by one attention kernel call, and the log-sum-exp merge of their results
// ([Note: the block plan] in blocks.cpp).
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/context_parallel.h>

namespace dtensor::detail::cp {

// Local query rows [q_begin, +q_len) of this rank against the source rank's local key rows
// [kv_begin, +kv_len), in batch rows [b_begin, +b_len); causal: the kernel's top-left causal
// mask (the two row ranges are then the same global positions), else no mask.
struct Block {
  int64_t b_begin;
  int64_t b_len;
  int64_t q_begin;
  int64_t q_len;
  int64_t kv_begin;
  int64_t kv_len;
  bool causal;
};

struct Plan {
  std::vector<Block> blocks;
  int64_t skipped = 0; // segment pairs the mask empties
};

// The blocks of `rank`'s queries against `src`'s keys, for a batch of `batch` rows.
Plan plan_blocks(const CpLayout& layout, int64_t rank, int64_t src, int64_t batch, bool causal);

// The attention kernel on one block: out in q's dtype, lse [B, H, Lq] in the kernel's dtype.
struct KernelOut {
  at::Tensor out;
  at::Tensor lse;
};
KernelOut kernel_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                         double scale);
// dq, dk, dv of one block, given the final (merged) out and lse of its query rows.
std::vector<at::Tensor> kernel_backward(const at::Tensor& dout, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& out, const at::Tensor& lse, bool causal,
                                        double scale);

// The fp32 accumulators of a call's output and log-sum-exp, merged block by block.
struct Accumulator {
  Accumulator(const at::Tensor& q);
  at::Tensor out;                        // [B, Hq, L, d] fp32, 0 where no block has contributed
  at::Tensor lse;                        // [B, Hq, L] fp32, -inf where no block has contributed
  at::ScalarType lse_dtype = at::kFloat; // what the kernel returns (its backward's input)
};

// Runs `plan`'s blocks of q against one source's k / v and merges them into `acc`.
void forward_blocks(Accumulator& acc, const Plan& plan, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, double scale);
// Every query row must have seen at least its own key: a row still at -inf is a bad plan.
void check_complete(const Accumulator& acc, const CpLayout& layout);

// The backward of `plan`'s blocks: adds into dq (fp32, q's shape) and dk / dv (fp32, the
// source's k / v shape).
void backward_blocks(const Plan& plan, const at::Tensor& dout, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                     const at::Tensor& lse, double scale, at::Tensor& dq, at::Tensor& dk,
                     at::Tensor& dv);

double softmax_scale(const at::Tensor& q, const std::optional<double>& scale);

// Process-wide counters behind cp_stats().
CpStats& stats();

} // namespace dtensor::detail::cp
