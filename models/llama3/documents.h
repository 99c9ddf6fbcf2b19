#pragma once

// Document masks for packed sequences: causal attention inside each document only.
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include <models/check.h>

namespace dtensor::models {

// [Note: document masks] A packed row holds several documents; under the document mask
// (torchtitan's attn_mask_type "block_causal") a token attends only to the tokens of its own
// document up to itself. The step's documents (each batch row's lengths, summing to the
// sequence length; one list: every row's) are set on the model before its forward
// (Llama3Impl::set_documents) and read by every block's inner attention, which then runs
// causal attention document by document (rows sharing their documents in one call). The
// rotary embeddings depend on relative positions only, so a document's attention is the
// model's on that document alone. None, or one document per row: plain causal attention.
// Context parallelism replaces the inner attention and takes the documents from its layout.
struct Documents {
  std::vector<std::vector<int64_t>> rows;
};
using DocumentsPtr = std::shared_ptr<Documents>;

// Causal attention of q / k / v [B, H, S, d] (k / v with q's heads) under `docs`.
inline at::Tensor document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const Documents* docs) {
  const auto causal = [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return at::scaled_dot_product_attention(a, b, c, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/true);
  };
  const int64_t batch = q.size(0), seq = q.size(2);
  bool split = false;
  for (const auto& row : docs != nullptr ? docs->rows : std::vector<std::vector<int64_t>>{}) {
    split = split || row.size() > 1;
  }
  if (!split) {
    return causal(q, k, v);
  }
  const auto& rows = docs->rows;
  DTENSOR_MODEL_CHECK(rows.size() == 1 || static_cast<int64_t>(rows.size()) == batch,
                      "attention: documents for ", rows.size(), " rows, but the batch has ", batch);
  std::vector<at::Tensor> out;
  for (int64_t b = 0; b < batch;) {
    const auto& row = rows[rows.size() == 1 ? 0 : static_cast<size_t>(b)];
    int64_t e = rows.size() == 1 ? batch : b + 1; // rows with the same documents: one call
    while (e < batch && rows[static_cast<size_t>(e)] == row) {
      ++e;
    }
    std::vector<at::Tensor> pieces;
    int64_t start = 0;
    for (int64_t len : row) {
      DTENSOR_MODEL_CHECK(len > 0 && start + len <= seq, "attention: documents ", row.size(),
                          " of a row do not fit its ", seq, " positions");
      const auto cut = [&](const at::Tensor& t) {
        return t.narrow(0, b, e - b).narrow(2, start, len);
      };
      pieces.push_back(causal(cut(q), cut(k), cut(v)));
      start += len;
    }
    DTENSOR_MODEL_CHECK(start == seq, "attention: a row's documents cover ", start, " of its ",
                        seq, " positions");
    out.push_back(at::cat(pieces, 2));
    b = e;
  }
  return out.size() == 1 ? out[0] : at::cat(out, 0);
}

} // namespace dtensor::models
