#pragma once

// A Llama-3 Transformer after torchtitan's models/llama3/model/model.py (RMSNorm pre-norm
// blocks, grouped-query attention with rotary embeddings and causal sdpa, SwiGLU, Linears
// without bias), with parameter names and order exactly torchtitan's, and its init_weights()
// on dtensor's layout-independent random ops (after parallelize / fully_shard / to_empty).
// With Llama3Args' attention_head_dim, qk_norm and moe it is also Qwen3(-MoE) and a
// DeepSeek-V3 MoE model (with Llama3Args' mla: multi-head latent attention, models/llama3/
// mla.h; with yarn: YaRN's rotary scaling). Left out: flex / varlen attention, positions,
// PEFT, tying, DeepSeek-V3's multi-token prediction.
//
// [Note: models carry no parallelism] As torchtitan's model.py, nothing here names a
// parallelism: submodules are called through dtensor::call (the module seam,
// dtensor/module_hooks.h), and tensor parallelism, fully_shard and activation checkpointing
// are applied from outside by parallelize_llama3 (models/llama3/parallelize.h), whose hooks
// run at those calls. The same forward runs the plain model on one process.
#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <string>
#include <utility>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <dtensor/module_hooks.h>
#include <dtensor/random.h>

#include <models/check.h>
#include <models/llama3/args.h>
#include <models/llama3/documents.h>
#include <models/llama3/kv_cache.h>
#include <models/llama3/layers.h>
#include <models/llama3/mla.h>
#include <models/llama3/rope.h>
#include <models/moe/moe.h>

namespace dtensor::models {

// ---------------------------------------------------------------------------------------------
// Modules
// ---------------------------------------------------------------------------------------------

// Causal scaled dot-product attention of q [bs, n_heads, seqlen, head_dim] over k / v
// [bs, n_kv_heads, seqlen, head_dim], each kv head repeated n_heads / n_kv_heads times in place
// (torchtitan's repeat_kv, torch.repeat_interleave on the heads): torchtitan's inner_attention, a
// module of its own without parameters, so that context parallelism can replace it from outside
// (apply_cp in models/llama3/parallelize.h) and receive k / v before their heads are repeated.
struct Llama3InnerAttentionImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const int64_t n_rep = q.size(1) / k.size(1); // global sizes: a TP DTensor's ratio too
    auto repeat = [&](const at::Tensor& x) {
      if (n_rep == 1) {
        return x;
      }
      const int64_t bs = x.size(0), n_kv = x.size(1), slen = x.size(2), hd = x.size(3);
      return x.unsqueeze(2)
          .expand({bs, n_kv, n_rep, slen, hd})
          .reshape({bs, n_kv * n_rep, slen, hd});
    };
    return document_attention(q, repeat(k), repeat(v), documents.get());
  }
  DocumentsPtr documents; // the model's, set per step ([Note: document masks])
};
TORCH_MODULE(Llama3InnerAttention);

// Grouped-query attention: wq (dim -> n_heads * head_dim), wk / wv (-> n_kv_heads * head_dim),
// rotary q / k, inner_attention (kv heads repeated to n_heads, causal sdpa), wo.
struct Llama3AttentionImpl : torch::nn::Module {
  explicit Llama3AttentionImpl(const Llama3Args& args)
      : head_dim(args.head_dim()),
        wq(register_module("wq", llama3_detail::linear(args.dim(), args.n_heads() * head_dim))),
        wk(register_module("wk", llama3_detail::linear(args.dim(), args.kv_heads() * head_dim))),
        wv(register_module("wv", llama3_detail::linear(args.dim(), args.kv_heads() * head_dim))),
        wo(register_module("wo", llama3_detail::linear(args.n_heads() * head_dim, args.dim()))),
        inner_attention(register_module("inner_attention", Llama3InnerAttention())) {
    DTENSOR_MODEL_CHECK(args.attention_head_dim() > 0 || args.dim() % args.n_heads() == 0,
                        "Llama3: dim must be a multiple of n_heads (or attention_head_dim set)");
    if (args.qk_norm()) {
      q_norm = register_module("q_norm", RMSNorm(head_dim, args.norm_eps()));
      k_norm = register_module("k_norm", RMSNorm(head_dim, args.norm_eps()));
    }
    DTENSOR_MODEL_CHECK(args.n_heads() % args.kv_heads() == 0,
                        "Llama3: n_heads must be a multiple of n_kv_heads");
    DTENSOR_MODEL_CHECK(head_dim % 2 == 0, "Llama3: rotary embeddings need an even head_dim");
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& freqs_cis) {
    const int64_t bs = x.size(0);
    const int64_t seqlen = x.size(1);
    // [Note: -1 heads] As torchtitan: -1, not n_heads / n_kv_heads, so the view also fits a
    // projection whose output is a local shard of the heads (a plain local tensor); dtensor's
    // DTensors have the global shape, where -1 gives the full count.
    at::Tensor xq = dtensor::call(wq, x).view({bs, seqlen, -1, head_dim});
    at::Tensor xk = dtensor::call(wk, x).view({bs, seqlen, -1, head_dim});
    at::Tensor xv = dtensor::call(wv, x).view({bs, seqlen, -1, head_dim});
    if (q_norm) { // per head, in Meta's rotary layout (its weight permuted as q's rows)
      xq = dtensor::call(q_norm, xq);
      xk = dtensor::call(k_norm, xk);
    }
    at::Tensor out; // [bs, heads, seqlen, head_dim]
    if (cache && cache->active()) { // [Note: the KV cache]
      out = cache->attend(layer_id, xq, xk, xv, freqs_cis);
    } else {
      auto [rot_cos, rot_sin] = rope_tables(freqs_cis, seqlen);
      xq = apply_rotary_emb(xq, rot_cos, rot_sin);
      xk = apply_rotary_emb(xk, rot_cos, rot_sin);
      out = dtensor::call(inner_attention, xq.transpose(1, 2), xk.transpose(1, 2),
                          xv.transpose(1, 2));
    }
    return dtensor::call(wo, out.transpose(1, 2).contiguous().view({bs, seqlen, -1}));
  }
  // torchtitan: wq / wk / wv trunc_normal_(std 0.02), wo trunc_normal_(init_std), both with
  // PyTorch's default bounds [-2, 2] (absolute, so hardly truncated at these stds).
  void init_weights(double init_std) {
    torch::NoGradGuard no_grad;
    for (torch::nn::Linear* l : {&wq, &wk, &wv}) {
      dtensor::trunc_normal_((*l)->weight, 0.0, 0.02);
    }
    dtensor::trunc_normal_(wo->weight, 0.0, init_std);
    if (q_norm) {
      q_norm->reset_parameters();
      k_norm->reset_parameters();
    }
  }
  int64_t head_dim;
  torch::nn::Linear wq;
  torch::nn::Linear wk;
  torch::nn::Linear wv;
  torch::nn::Linear wo;
  Llama3InnerAttention inner_attention;
  RMSNorm q_norm{nullptr}; // with qk_norm
  RMSNorm k_norm{nullptr};
  int64_t layer_id = 0; // its block's, the index of its layer in the KV cache
  KvCachePtr cache;     // the model's ([Note: the KV cache]); inactive outside generation
};
TORCH_MODULE(Llama3Attention);

// h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h)), or moe in place
// of feed_forward in a mixture-of-experts layer (Llama3Args::is_moe_layer; torchtitan's
// qwen3 / deepseek_v3 blocks). Submodules in torchtitan's order (attention, feed_forward or
// moe, attention_norm, ffn_norm).
struct Llama3BlockImpl : torch::nn::Module {
  Llama3BlockImpl(int64_t id, const Llama3Args& args)
      : layer_id(id), weight_init_std(init_std(id, args)) {
    if (args.mla()) {
      mla = register_module("attention", MLAttention(args));
    } else {
      attention = register_module("attention", Llama3Attention(args));
    }
    if (args.is_moe_layer(id)) {
      moe = register_module("moe", MoE(args.moe_args()));
    } else {
      feed_forward =
          register_module("feed_forward", Llama3FeedForward(args.dim(), args.ffn_hidden_dim()));
    }
    attention_norm = register_module("attention_norm", RMSNorm(args.dim(), args.norm_eps()));
    ffn_norm = register_module("ffn_norm", RMSNorm(args.dim(), args.norm_eps()));
  }
  // torchtitan: 0.02 / sqrt(2 * (layer_id + 1)) with depth_init, else 0.02 / sqrt(2 * n_layers).
  static double init_std(int64_t layer_id, const Llama3Args& args) {
    const int64_t depth = args.depth_init() ? layer_id + 1 : args.n_layers();
    return 0.02 / std::sqrt(2.0 * static_cast<double>(depth));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& freqs_cis) {
    at::Tensor normed_x = dtensor::call(attention_norm, x);
    at::Tensor h = x + (mla ? dtensor::call(mla, normed_x, freqs_cis)
                            : dtensor::call(attention, normed_x, freqs_cis));
    at::Tensor normed = dtensor::call(ffn_norm, h);
    return h + (moe ? dtensor::call(moe, normed) : dtensor::call(feed_forward, normed));
  }
  void init_weights() {
    attention_norm->reset_parameters();
    ffn_norm->reset_parameters();
    if (mla) {
      mla->init_weights(weight_init_std);
    } else {
      attention->init_weights(weight_init_std);
    }
    if (moe) {
      moe->init_weights(weight_init_std);
    } else {
      feed_forward->init_weights(weight_init_std);
    }
  }
  Llama3Attention attention{nullptr}; // grouped-query attention, or
  MLAttention mla{nullptr};           // multi-head latent attention (both named "attention")
  Llama3FeedForward feed_forward{nullptr}; // a dense layer's
  MoE moe{nullptr};                        // a mixture-of-experts layer's
  RMSNorm attention_norm{nullptr};
  RMSNorm ffn_norm{nullptr};
  int64_t layer_id; // its index in the whole model (a pipeline stage holds some blocks)
  double weight_init_std;
};
TORCH_MODULE(Llama3Block);

// forward(tokens [bs, seqlen] int64) -> logits [bs, seqlen, vocab_size] in the parameters'
// dtype, as torchtitan (its loss casts to fp32). Rotary tables: the buffer freqs_cis.
// [Note: freqs_cis is persistent] LibTorch has no persistent=False buffers: freqs_cis is in
// named_buffers() and state dicts, where torchtitan's is not; to_hf skips it.
// The constructor leaves LibTorch's default init: call init_weights() (after to_empty when
// built on the meta device, docs/meta_init.md).
struct Llama3Impl : torch::nn::Module {
  explicit Llama3Impl(const Llama3Args& args = Llama3Args())
      : model_args(args),
        tok_embeddings(
            register_module("tok_embeddings", torch::nn::Embedding(args.vocab_size(), args.dim()))),
        freqs_cis(register_buffer("freqs_cis", compute_freqs_cis({}))),
        layers(register_module("layers", torch::nn::ModuleList())) {
    for (int64_t i = 0; i < args.n_layers(); ++i) {
      Llama3Block block(i, args);
      if (block->mla) {
        block->mla->inner_attention->documents = documents;
      } else {
        block->attention->inner_attention->documents = documents;
        block->attention->layer_id = i;
        block->attention->cache = kv_cache;
      }
      layers->push_back(block);
    }
    norm = register_module("norm", RMSNorm(args.dim(), args.norm_eps()));
    output = register_module("output", llama3_detail::linear(args.dim(), args.vocab_size()));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    check_positions(tokens.size(1));
    at::Tensor h = dtensor::call(tok_embeddings, tokens);
    for (const auto& layer : *layers) {
      h = dtensor::call(*layer->as<Llama3BlockImpl>(), h, freqs_cis);
    }
    return dtensor::call(output, dtensor::call(norm, h));
  }
  // torchtitan's Transformer.init_weights: freqs_cis recomputed, tok_embeddings normal (std 1),
  // the blocks', norm one, output truncated normal (std dim^-0.5, within 3 std). Every value
  // from dtensor's random ops (docs/random.md) or a constant, in a fixed order: the same full
  // values on every layout (plain, TP, FSDP, both) for the same seed.
  void init_weights() {
    torch::NoGradGuard no_grad;
    freqs_cis.copy_(compute_freqs_cis(at::TensorOptions().device(freqs_cis.device())));
    dtensor::normal_(tok_embeddings->weight, 0.0, 1.0);
    for (const auto& layer : *layers) {
      layer->as<Llama3BlockImpl>()->init_weights();
    }
    norm->reset_parameters();
    const double final_out_std = 1.0 / std::sqrt(static_cast<double>(model_args.dim()));
    dtensor::trunc_normal_(output->weight, 0.0, final_out_std, -3.0 * final_out_std,
                           3.0 * final_out_std);
  }
  // Every position of the next forward's `seqlen` tokens a row (from the KV cache's positions
  // when one is active) within max_seq_len and the cache.
  void check_positions(int64_t seqlen) const {
    const int64_t max_seq = freqs_cis.size(0);
    if (!kv_cache->active()) {
      DTENSOR_MODEL_CHECK(seqlen <= max_seq, "Llama3: sequence of ", seqlen,
                          " tokens is longer than max_seq_len ", max_seq);
      return;
    }
    DTENSOR_MODEL_CHECK(!model_args.mla(),
                        "Llama3: multi-head latent attention has no KV cache (decode without one)");
    for (size_t b = 0; b < kv_cache->positions.size(); ++b) {
      const int64_t end = kv_cache->positions[b] + seqlen;
      DTENSOR_MODEL_CHECK(end <= max_seq && end <= kv_cache->capacity, "Llama3: row ", b,
                          " would reach position ", end, ", past max_seq_len ", max_seq,
                          " or the KV cache's ", kv_cache->capacity, " positions");
    }
  }
  // The documents of the next forwards' rows ([Note: document masks]); empty: causal over the
  // whole row.
  void set_documents(std::vector<std::vector<int64_t>> rows) { documents->rows = std::move(rows); }
  at::Tensor compute_freqs_cis(const at::TensorOptions& options) const {
    return precompute_freqs_cis(model_args.rope_dim(), model_args.max_seq_len(),
                                model_args.rope_theta(), model_args.rope_scaling(), options,
                                model_args.yarn());
  }

  Llama3Args model_args;
  DocumentsPtr documents = std::make_shared<Documents>(); // shared by every block's attention
  KvCachePtr kv_cache = std::make_shared<KvCache>(); // generation's ([Note: the KV cache])
  torch::nn::Embedding tok_embeddings;
  at::Tensor freqs_cis;
  torch::nn::ModuleList layers;
  RMSNorm norm{nullptr};
  torch::nn::Linear output{nullptr};
};
TORCH_MODULE(Llama3);

// torchtitan's FLOPs per token, the numerator of MFU (get_dense_model_nparams_and_flops, and
// get_moe_model_nparams_and_flops's active parameters): 6 x the parameters a token's matmuls
// use (all but the embeddings; of the routed experts, top_k / num_experts of them) plus
// 6 x layers x heads x (q/k + v head widths) x seq_len for attention's two products (causal
// masking not discounted, recomputation not counted). From the parameters' shapes: call it on
// the model before it is parallelized (on the meta device is fine).
inline int64_t llama3_flops_per_token(Llama3& model, int64_t seq_len) {
  const Llama3Args& a = model->model_args;
  int64_t dense = 0;
  int64_t experts = 0;
  for (const auto& p : model->named_parameters()) {
    const std::string& name = p.key();
    if (name.rfind("tok_embeddings.", 0) == 0) {
      continue;
    }
    (name.find(".moe.experts.") != std::string::npos ? experts : dense) += p.value().numel();
  }
  const int64_t active =
      a.moe() ? experts * a.moe()->top_k() / a.moe()->num_experts() : experts;
  const int64_t qk_v = a.mla() ? a.mla()->qk_head_dim() + a.mla()->v_head_dim() : 2 * a.head_dim();
  return 6 * (dense + active) + 6 * a.n_layers() * a.n_heads() * qk_v * seq_len;
}

} // namespace dtensor::models
