#pragma once

// The Llama-3 model's arguments and torchtitan's flavors (torchtitan's
// models/llama3/model/args.py and the flavors of its __init__.py).
#include <cstdint>
#include <optional>
#include <string>

#include <torch/arg.h>

#include <models/moe/args.h>

namespace dtensor::models {

// Llama 3.1's RoPE frequency scaling (torchtitan's RoPEScalingArgs; Hugging Face's
// rope_scaling with rope_type "llama3").
struct Llama3RopeScaling {
  TORCH_ARG(double, scaling_factor) = 8.0;
  TORCH_ARG(double, low_freq_factor) = 1.0;
  TORCH_ARG(double, high_freq_factor) = 4.0;
  TORCH_ARG(int64_t, original_max_position_embeddings) = 8192;
};

// YaRN's RoPE frequency scaling (Hugging Face's rope_type "yarn", as DeepSeek-V3 uses it):
// frequencies interpolated by `factor` below the band [beta_slow, beta_fast] rotations over
// original_max_position_embeddings, kept above it, ramped between; cos / sin multiplied by
// the attention factor (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), or
// get_mscale(factor) when either is 0); with multi-head latent attention the softmax scale
// multiplied by get_mscale(factor, mscale_all_dim)^2. get_mscale(s, m) = 0.1 m ln(s) + 1.
struct YarnRope {
  TORCH_ARG(double, factor) = 40.0;
  TORCH_ARG(int64_t, original_max_position_embeddings) = 4096;
  TORCH_ARG(double, beta_fast) = 32.0;
  TORCH_ARG(double, beta_slow) = 1.0;
  TORCH_ARG(double, mscale) = 1.0;         // 0: absent
  TORCH_ARG(double, mscale_all_dim) = 1.0; // 0: absent
};

// DeepSeek-V3's multi-head latent attention (torchtitan's MLA; Hugging Face's
// DeepseekV3Attention): q through a low-rank latent (q_lora_rank; 0: one projection), k / v
// from a shared latent of kv_lora_rank plus one rotary key of qk_rope_head_dim shared by the
// heads; each head's q / k of qk_nope_head_dim + qk_rope_head_dim, its v of v_head_dim.
struct MLAArgs {
  TORCH_ARG(int64_t, q_lora_rank) = 0;
  TORCH_ARG(int64_t, kv_lora_rank) = 512;
  TORCH_ARG(int64_t, qk_nope_head_dim) = 128;
  TORCH_ARG(int64_t, qk_rope_head_dim) = 64;
  TORCH_ARG(int64_t, v_head_dim) = 128;
  // The latents' RMSNorm eps (Hugging Face's q_a_layernorm / kv_a_layernorm: always 1e-6).
  TORCH_ARG(double, latent_norm_eps) = 1e-6;

 public:
  int64_t qk_head_dim() const { return qk_nope_head_dim() + qk_rope_head_dim(); }
};

// torchtitan's TransformerModelArgs; chainable: Llama3Args().dim(512).n_kv_heads(4).
// Defaults: torchtitan's "debugmodel" flavor, except max_seq_len, which torchtitan overwrites
// with the training seq_len (2048 in its debug config) in update_from_config.
struct Llama3Args {
  TORCH_ARG(int64_t, dim) = 256;
  TORCH_ARG(int64_t, n_layers) = 6;
  TORCH_ARG(int64_t, n_heads) = 16;
  TORCH_ARG(int64_t, n_kv_heads) = 0; // 0: n_heads (torchtitan's None)
  TORCH_ARG(int64_t, vocab_size) = 2048;
  TORCH_ARG(int64_t, multiple_of) = 256;
  TORCH_ARG(double, ffn_dim_multiplier) = 0.0; // 0: none (torchtitan's None)
  TORCH_ARG(double, norm_eps) = 1e-5;
  TORCH_ARG(double, rope_theta) = 500000.0;
  // torchtitan's args.py applies Llama 3.1's scaling by default; nullopt: plain RoPE (Llama 3.0).
  TORCH_ARG(std::optional<Llama3RopeScaling>, rope_scaling) = Llama3RopeScaling();
  TORCH_ARG(int64_t, max_seq_len) = 2048;
  // The feed-forward width as given (a Hugging Face config's intermediate_size); 0: computed
  // from dim, multiple_of and ffn_dim_multiplier as torchtitan.
  TORCH_ARG(int64_t, ffn_hidden) = 0;
  // Init std of wo / w2 / w3: by layer id (true) or by n_layers (false), as torchtitan.
  TORCH_ARG(bool, depth_init) = true;
  // Each head's width; 0: dim / n_heads. (Qwen3 sets it apart: 128 at dim 2048, 32 heads.)
  TORCH_ARG(int64_t, attention_head_dim) = 0;
  // RMSNorm over each head of q and k before the rotary embedding (Qwen3's q_norm / k_norm).
  TORCH_ARG(bool, qk_norm) = false;
  // Mixture-of-experts feed-forwards (models/moe/moe.h; their dim is this model's) in the
  // layers from n_dense_layers on, dense SwiGLU ones before (DeepSeek-V3's first_k_dense,
  // Hugging Face's mlp_only_layers); nullopt: every layer dense.
  TORCH_ARG(std::optional<MoEArgs>, moe) = std::nullopt;
  TORCH_ARG(int64_t, n_dense_layers) = 0;
  // Multi-head latent attention in place of grouped-query attention (DeepSeek-V3).
  TORCH_ARG(std::optional<MLAArgs>, mla) = std::nullopt;
  // YaRN's rotary scaling in place of rope_scaling's (DeepSeek-V3's checkpoints).
  TORCH_ARG(std::optional<YarnRope>, yarn) = std::nullopt;

 public:
  int64_t kv_heads() const { return n_kv_heads() > 0 ? n_kv_heads() : n_heads(); }
  int64_t head_dim() const {
    return attention_head_dim() > 0 ? attention_head_dim() : dim() / n_heads();
  }
  // The width the rotary embedding turns: a head's, or MLA's rotary part.
  int64_t rope_dim() const { return mla() ? mla()->qk_rope_head_dim() : head_dim(); }
  bool is_moe_layer(int64_t layer_id) const {
    return moe().has_value() && layer_id >= n_dense_layers();
  }
  // The MoE layers' arguments, their dim this model's.
  MoEArgs moe_args() const {
    MoEArgs a = moe().value_or(MoEArgs());
    return a.dim(dim());
  }
  // torchtitan's FeedForward: int(2 * (4 * dim) / 3), times ffn_dim_multiplier (truncated),
  // rounded up to a multiple of multiple_of. (8B: 4096 -> 14336.)
  int64_t ffn_hidden_dim() const {
    if (ffn_hidden() > 0) {
      return ffn_hidden();
    }
    int64_t hidden = 2 * (4 * dim()) / 3;
    if (ffn_dim_multiplier() > 0.0) {
      hidden = static_cast<int64_t>(ffn_dim_multiplier() * static_cast<double>(hidden));
    }
    return multiple_of() * ((hidden + multiple_of() - 1) / multiple_of());
  }
};

// torchtitan's "8B" flavor (max_seq_len: its llama3_8b training seq_len).
inline Llama3Args llama3_8b_args() {
  return Llama3Args()
      .dim(4096)
      .n_layers(32)
      .n_heads(32)
      .n_kv_heads(8)
      .vocab_size(128256)
      .multiple_of(1024)
      .ffn_dim_multiplier(1.3)
      .rope_theta(500000.0)
      .max_seq_len(8192);
}

// torchtitan's "70B" and "405B" flavors.
inline Llama3Args llama3_70b_args() {
  return llama3_8b_args().dim(8192).n_layers(80).n_heads(64).multiple_of(4096);
}

inline Llama3Args llama3_405b_args() {
  return llama3_8b_args()
      .dim(16384)
      .n_layers(126)
      .n_heads(128)
      .multiple_of(4096)
      .ffn_dim_multiplier(1.2);
}

// Qwen3-30B-A3B (Hugging Face's Qwen/Qwen3-30B-A3B config.json): 48 layers, every one a
// mixture of 128 experts, 8 chosen by softmax scores renormalised (norm_topk_prob), no shared
// experts; explicit head_dim and q / k norms; max_seq_len: 4096, a training length.
inline Llama3Args qwen3_30b_a3b_args() {
  return Llama3Args()
      .dim(2048)
      .n_layers(48)
      .n_heads(32)
      .n_kv_heads(4)
      .attention_head_dim(128)
      .qk_norm(true)
      .vocab_size(151936)
      .ffn_hidden(6144)
      .norm_eps(1e-6)
      .rope_theta(1000000.0)
      .rope_scaling(std::nullopt)
      .max_seq_len(4096)
      .moe(MoEArgs()
               .hidden_dim(768)
               .num_experts(128)
               .top_k(8)
               .score_func(MoEScore::Softmax)
               .route_norm(true));
}

// A DeepSeek-V3-style model at a small size: grouped-query attention (not multi-head latent
// attention) with MoE blocks after the first dense one: sigmoid scores, 8 groups of experts of
// which 4 are kept per token, the chosen scores renormalised and scaled by 2.5, one shared
// expert, the load-balancing bias (DeepSeek-V3's config.json at 1/32 of its width).
inline Llama3Args deepseek_v3_small_args() {
  return Llama3Args()
      .dim(224)
      .n_layers(4)
      .n_heads(16)
      .n_kv_heads(16)
      .attention_head_dim(64)
      .vocab_size(4096)
      .ffn_hidden(576)
      .norm_eps(1e-6)
      .rope_theta(10000.0)
      .rope_scaling(std::nullopt)
      .max_seq_len(512)
      .n_dense_layers(1)
      .moe(MoEArgs()
               .hidden_dim(64)
               .num_experts(32)
               .top_k(8)
               .num_shared_experts(1)
               .score_func(MoEScore::Sigmoid)
               .num_expert_groups(8)
               .num_limited_groups(4)
               .route_norm(true)
               .route_scale(2.5));
}

// A tiny Qwen3-MoE for tests and the Hugging Face exchange: dim 64, 2 layers (the first
// dense), head_dim 32 apart from dim / n_heads, q / k norms, 8 experts of width 32, top 2.
inline Llama3Args qwen3_moe_tiny_args() {
  return Llama3Args()
      .dim(64)
      .n_layers(2)
      .n_heads(4)
      .n_kv_heads(2)
      .attention_head_dim(32)
      .qk_norm(true)
      .vocab_size(256)
      .ffn_hidden(96)
      .norm_eps(1e-6)
      .rope_theta(1000000.0)
      .rope_scaling(std::nullopt)
      .max_seq_len(16)
      .n_dense_layers(1)
      .moe(MoEArgs().hidden_dim(32).num_experts(8).top_k(2).route_norm(true));
}

// torchtitan's flavor by name ("debugmodel", "llama3-8b", "llama3-70b", "llama3-405b"), if it
// is one.
inline std::optional<Llama3Args> llama3_preset(const std::string& name) {
  if (name == "debugmodel") {
    return Llama3Args(); // the defaults are torchtitan's debugmodel
  }
  if (name == "llama3-8b") {
    return llama3_8b_args();
  }
  if (name == "llama3-70b") {
    return llama3_70b_args();
  }
  if (name == "llama3-405b") {
    return llama3_405b_args();
  }
  return std::nullopt;
}

// A tiny model for tests and interchange checks (dim 64, 2 layers, 4 heads, 2 kv heads, vocab
// 256, plain RoPE).
inline Llama3Args llama3_tiny_args() {
  return Llama3Args()
      .dim(64)
      .n_layers(2)
      .n_heads(4)
      .n_kv_heads(2)
      .vocab_size(256)
      .multiple_of(32)
      .rope_theta(10000.0)
      .rope_scaling(std::nullopt)
      .max_seq_len(16);
}

} // namespace dtensor::models
