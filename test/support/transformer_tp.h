#pragma once

// The Transformer of models/fsdp_models.h laid out as torchtitan lays out its Llama: shared by
// the tests of meta init and HSDP x TP.
#include <dtensor/all.h>

#include "support/pieces.h"
#include <models/fsdp_models.h>

namespace dtensor::testing {

// The small Transformer's vocabulary and sequence length, and the global batch the tests
// train it on.
constexpr int64_t kVocab = 16;
constexpr int64_t kSeq = 8;
constexpr int64_t kBatch = 8;

// A small Transformer with layout-independent dropout (0.1 unless `dropout_p`) and no
// weight tying (the output projection is its own, plain parameter).
inline dtensor::models::ModelArgs small_transformer_args(double dropout_p = 0.1) {
  return dtensor::models::ModelArgs()
      .n_layers(2)
      .vocab_size(kVocab)
      .max_seq_len(kSeq)
      .dim(32)
      .n_heads(8)
      .dropout_p(dropout_p)
      .weight_tying(false)
      .layout_independent_dropout(true);
}

// Embeddings row-wise (vocab / positions sharded), attention and MLP tensor-parallel, every
// output a DTensor, so the residual stream and its dropout are DTensors (Replicate).
// ([Note: local outputs]: a random op on an activation handed on as its local tensor runs as
// a plain op, outside the layout-independent rule.) Per forward over tp: one all-reduce per
// embedding (2) and per row-wise projection (2 per block).
inline void parallelize_transformer_tp(dtensor::models::Transformer& model, const DeviceMesh& tp) {
  const auto embedding =
      RowwiseParallel().input_layouts(Placement::replicate()).use_local_output(false);
  dtensor::parallelize_module(
      *model, tp,
      dtensor::ParallelizePlan{
          {"tok_embeddings", embedding},
          {"pos_embeddings", embedding},
          {"layers.*.attention.w[qkv]", ColwiseParallel().use_local_output(false)},
          {"layers.*.attention.wo", RowwiseParallel().use_local_output(false)},
          {"layers.*.feed_forward.w1", ColwiseParallel().use_local_output(false)},
          {"layers.*.feed_forward.w2", RowwiseParallel().use_local_output(false)},
      });
}

// Logits as one tensor, autograd kept: a DTensor's full tensor (Replicate: no collective).
inline at::Tensor whole(const at::Tensor& t) {
  return dtensor::is_dtensor(t) ? DTensor(t).full_tensor() : t;
}

// This rank's slice of the global batch: its row-major index over the data-parallel dims
// (undefined mesh: the whole batch), and their total size.
inline std::pair<int64_t, int64_t> batch_slice(const DeviceMesh& dp) {
  if (!dp.defined()) {
    return {0, 1};
  }
  auto coordinate = dp.get_coordinate();
  int64_t index = 0;
  for (int64_t d = 0; d < dp.ndim(); ++d) {
    index = index * dp.size(d) + (*coordinate)[static_cast<size_t>(d)];
  }
  return {index, dp.size()};
}

} // namespace dtensor::testing
