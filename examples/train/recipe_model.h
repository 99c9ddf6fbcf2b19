#pragma once

// The recipe's models (docs/recipe.md, "Models"): --model / --preset names torchtitan's flavors
// (Llama 3 8B / 70B / 405B, Qwen3-30B-A3B, DeepSeek-V3-16B: what the simulator plans) and two
// small mixture-of-experts shapes whose width and depth come from --dim / --layers / --heads /
// --kv-heads like the default Llama's: `qwen3-moe` (every block after the first an MoE of
// --experts experts, top 2, softmax scores renormalised, q / k norms) and `deepseek-v3` (sigmoid
// scores over 4 expert groups of which 2 are kept, one shared expert, route scale 2.5, the
// load-balancing bias).
#include <optional>
#include <string>
#include <vector>

#include <dtensor/activation_checkpoint.h>
#include <dtensor/clip_grad.h>
#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>
#include <dtensor/module_hooks.h>

#include <models/llama3.h>

#include "llama_flags.h"

namespace dtensor::train {

// DeepSeek-V3-16B (torchtitan's deepseek_v3 "16B", DeepSeek-V2-Lite's shape) with grouped-query
// attention in place of multi-head latent attention: 16 heads of 128 (MLA's 192-wide queries
// and 512-rank K/V are not modelled; 17 M attention parameters a block against MLA's 14 M).
inline models::Llama3Args deepseek_v3_16b_args() {
  return models::Llama3Args()
      .dim(2048)
      .n_layers(27)
      .n_heads(16)
      .n_kv_heads(16)
      .attention_head_dim(128)
      .vocab_size(102400)
      .ffn_hidden(10944)
      .norm_eps(1e-6)
      .rope_theta(10000.0)
      .rope_scaling(std::nullopt)
      .max_seq_len(4096)
      .n_dense_layers(1)
      .moe(models::MoEArgs()
               .hidden_dim(1408)
               .num_experts(64)
               .top_k(6)
               .num_shared_experts(2)
               .score_func(models::MoEScore::Softmax)
               .route_norm(false));
}

// The small shapes: the default Llama's arguments with MoE blocks.
inline models::Llama3Args small_moe_args(const Flags& f, models::Llama3Args base) {
  const int64_t hidden = std::max<int64_t>(8, f.dim / 2);
  if (f.preset == "qwen3-moe") {
    return base.qk_norm(true).n_dense_layers(1).moe(
        models::MoEArgs().hidden_dim(hidden).num_experts(f.experts).top_k(2).route_norm(true));
  }
  return base.n_dense_layers(1).moe(models::MoEArgs()
                                        .hidden_dim(hidden)
                                        .num_experts(f.experts)
                                        .top_k(2)
                                        .num_shared_experts(1)
                                        .score_func(models::MoEScore::Sigmoid)
                                        .num_expert_groups(4)
                                        .num_limited_groups(2)
                                        .route_norm(true)
                                        .route_scale(2.5));
}

// The model's arguments for the flags and a tokenizer of `vocab` ids.
inline models::Llama3Args recipe_model_args(const Flags& f, int64_t vocab) {
  if (!f.init_from_hf.empty()) {
    models::Llama3Args a = models::args_from_hf(f.init_from_hf);
    if (a.vocab_size() < vocab) {
      usage(f.init_from_hf + " has a vocabulary of " + std::to_string(a.vocab_size()) +
            ", the text needs " + std::to_string(vocab));
    }
    return a.max_seq_len(std::max(a.max_seq_len(), f.seq));
  }
  std::optional<models::Llama3Args> big = models::llama3_preset(f.preset);
  if (f.preset == "qwen3-30b-a3b") {
    big = models::qwen3_30b_a3b_args();
  } else if (f.preset == "deepseek-v3-16b") {
    big = deepseek_v3_16b_args();
  }
  if (big) {
    if (big->vocab_size() < vocab) {
      usage("--preset " + f.preset + " has a vocabulary of " + std::to_string(big->vocab_size()) +
            " ids, the tokenizer " + std::to_string(vocab));
    }
    return big->max_seq_len(std::max(big->max_seq_len(), f.seq));
  }
  models::Llama3Args a = models::Llama3Args()
                             .dim(f.dim)
                             .n_layers(f.layers)
                             .n_heads(f.heads)
                             .n_kv_heads(f.kv_heads)
                             .vocab_size((vocab + 7) / 8 * 8) // padded, as torchtitan pads
                             .multiple_of(32)
                             .rope_theta(10000.0)
                             .rope_scaling(std::nullopt)
                             .max_seq_len(f.seq);
  return f.preset.empty() ? a : small_moe_args(f, a);
}

// --ac: none, full, or torchtitan's selective "op" mode (matmuls and attention kept); with
// --ac-every N on every N-th block only (torchtitan's layer-frequency selective mode).
inline std::optional<models::Llama3Ac> ac_options(const Flags& f) {
  if (f.ac == "none") {
    return std::nullopt;
  }
  ActivationCheckpointOptions o;
  if (f.ac == "selective") {
    o.policy(save_ops({"aten::mm", "aten::addmm", "aten::bmm",
                       "aten::_scaled_dot_product_flash_attention_for_cpu",
                       "aten::_scaled_dot_product_flash_attention",
                       "aten::_scaled_dot_product_efficient_attention"}));
  }
  return models::Llama3Ac(o, f.ac_every);
}

} // namespace dtensor::train
