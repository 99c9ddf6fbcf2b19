#pragma once

// The key / value cache of incremental decoding for the Llama-3 family's grouped-query attention.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <dtensor/placement.h>
#include <dtensor/user_rules.h>

#include <models/check.h>
#include <models/llama3/rope.h>

namespace dtensor::models {

// [Note: the KV cache] Generation feeds a model only the tokens it has not seen: a prompt's
// (prefill), then one token a row. Each attention keeps the keys and values of every position
// seen so far in a cache of `capacity` positions, [batch, kv heads, capacity, head_dim], and the
// rows' next positions say where the new tokens go: row b's i-th new token sits at position
// positions[b] + i, its rotary angle is that position's, its key and value are written there,
// and it attends to the positions 0 .. positions[b] + i of its own row. Rows of a batch can thus
// hold prompts of different lengths without padding on the left (a row's unused positions past
// its length are never attended to, and are overwritten by its next token), so that every row's
// values are the ones it would have alone. A prefill (every row at position 0) is the model's
// plain causal attention on the whole batch. The cache holds what the attention computes: under
// tensor parallelism each rank's heads only (models/llama3/parallelize.h,
// parallelize_llama3_generator: the attention over the cache is a local region, attend below),
// allocated at a layer's first use in the dtype and on the device of its keys. Inactive
// (capacity 0): the model's forward is the plain one.
struct KvCache {
  std::vector<int64_t> positions; // each row's position of its first token in the next forward
  int64_t capacity = 0;
  std::vector<at::Tensor> keys; // by layer id; undefined until the layer's first use
  std::vector<at::Tensor> values;

  bool active() const { return capacity > 0; }

  // Starts a cache of `capacity` positions for `batch` rows (all at position 0) of a model of
  // `n_layers` attentions; frees the previous one.
  void reset(int64_t batch, int64_t capacity_, int64_t n_layers) {
    DTENSOR_MODEL_CHECK(batch > 0 && capacity_ > 0, "KvCache: ", batch, " rows of ", capacity_,
                        " positions: both must be positive");
    positions.assign(static_cast<size_t>(batch), 0);
    capacity = capacity_;
    keys.assign(static_cast<size_t>(n_layers), at::Tensor());
    values.assign(static_cast<size_t>(n_layers), at::Tensor());
  }
  // Frees the cache; the model's forward is the plain one again.
  void clear() {
    positions.clear();
    capacity = 0;
    keys.clear();
    values.clear();
  }
  // Bytes this process holds (keys and values of every layer used so far).
  int64_t bytes() const {
    int64_t total = 0;
    for (const auto* list : {&keys, &values}) {
      for (const at::Tensor& t : *list) {
        total += t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
      }
    }
    return total;
  }

  // The positions of a forward of `seqlen` new tokens a row: [batch, seqlen] int64 on `device`.
  at::Tensor token_positions(int64_t seqlen, const at::Device& device) const {
    DTENSOR_MODEL_CHECK(active(), "KvCache: no cache started (reset it first)");
    const auto batch = static_cast<int64_t>(positions.size());
    const at::Tensor start = at::tensor(positions, at::kLong).view({batch, 1});
    return (start + at::arange(seqlen, at::kLong).view({1, seqlen})).to(device);
  }

  // The rotary (cos, sin) tables at the tokens' positions, [batch, seqlen, 1, head_dim / 2]
  // (rope_tables' shape with the rows' own positions).
  std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& freqs_cis, int64_t seqlen) const {
    const auto batch = static_cast<int64_t>(positions.size());
    const at::Tensor index = token_positions(seqlen, freqs_cis.device()).flatten();
    at::Tensor f = freqs_cis.index_select(0, index).to(at::kFloat);
    const int64_t half = f.size(1);
    auto table = [&](int64_t i) {
      return f.select(-1, i).contiguous().view({batch, seqlen, 1, half});
    };
    return {table(0), table(1)};
  }

  // Layer `layer`'s attention of the new tokens' q, k, v [batch, seqlen, heads, head_dim]
  // (before their rotary embeddings) to every position seen by their row, with the rotary
  // tables of `freqs_cis`: [batch, heads, seqlen, head_dim]. A local region
  // (dtensor::local_map): heads are independent, so under tensor parallelism each rank
  // attends its own heads (q / k / v sharded by head) and its cache holds only those; on
  // plain tensors it is the plain computation.
  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& freqs_cis) {
    const dtensor::LocalFn local = dtensor::local_map(
        [this, layer](const std::vector<at::Tensor>& in) {
          auto [rot_cos, rot_sin] = rope_tables(in[3], in[0].size(1));
          return std::vector<at::Tensor>{attend_local(
              layer, apply_rotary_emb(in[0], rot_cos, rot_sin).transpose(1, 2),
              apply_rotary_emb(in[1], rot_cos, rot_sin).transpose(1, 2), in[2].transpose(1, 2))};
        },
        dtensor::LocalMapOptions().out_placements(
            {dtensor::Placements{dtensor::Placement::shard(1)}}));
    return local({q, k, v, freqs_cis})[0];
  }

 private:
  // attend's local body, after the rotary embeddings: q [batch, heads, seqlen, head_dim] (this
  // rank's heads), k / v [batch, kv heads, seqlen, head_dim] written at their positions.
  at::Tensor attend_local(int64_t layer, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v) {
    const int64_t batch = k.size(0), kv_heads = k.size(1), seqlen = k.size(2), hd = k.size(3);
    DTENSOR_MODEL_CHECK(layer >= 0 && layer < static_cast<int64_t>(keys.size()) &&
                            batch == static_cast<int64_t>(positions.size()),
                        "KvCache: layer ", layer, " with ", batch, " rows, but the cache has ",
                        keys.size(), " layers of ", positions.size(), " rows");
    auto& key_cache = keys[static_cast<size_t>(layer)];
    auto& value_cache = values[static_cast<size_t>(layer)];
    if (!key_cache.defined()) {
      key_cache = at::zeros({batch, kv_heads, capacity, hd}, k.options());
      value_cache = at::zeros({batch, kv_heads, capacity, hd}, v.options());
    }
    const at::Tensor pos = token_positions(seqlen, k.device());
    const at::Tensor index = pos.view({batch, 1, seqlen, 1}).expand({batch, kv_heads, seqlen, hd});
    key_cache.scatter_(2, index, k);
    value_cache.scatter_(2, index, v);
    const int64_t used = *std::max_element(positions.begin(), positions.end()) + seqlen;
    const int64_t n_rep = q.size(1) / kv_heads;
    auto repeat = [&](const at::Tensor& x) {
      const at::Tensor seen = x.narrow(2, 0, used);
      return n_rep == 1 ? seen
                        : seen.unsqueeze(2)
                              .expand({batch, kv_heads, n_rep, used, hd})
                              .reshape({batch, kv_heads * n_rep, used, hd});
    };
    const bool prefill =
        std::all_of(positions.begin(), positions.end(), [](int64_t p) { return p == 0; });
    if (prefill) { // `used` == seqlen: the plain causal attention
      return at::scaled_dot_product_attention(q, repeat(key_cache), repeat(value_cache), {}, 0.0,
                                              /*is_causal=*/true);
    }
    const at::Tensor seen = at::arange(used, pos.options()).view({1, 1, 1, used});
    const at::Tensor mask = seen <= pos.view({batch, 1, seqlen, 1});
    return at::scaled_dot_product_attention(q, repeat(key_cache), repeat(value_cache), mask);
  }
};
using KvCachePtr = std::shared_ptr<KvCache>;

} // namespace dtensor::models
