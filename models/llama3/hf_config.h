#pragma once

// config.json of a Hugging Face model folder for the Llama-3 family: what hf_config writes
// (LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM) and what
// args_from_hf reads back as Llama3Args (models/llama3/state_dict_adapter.h writes and reads
// the weights).
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include <models/check.h>
#include <models/llama3/args.h>

namespace dtensor::models {

namespace llama3_detail {

// What Qwen3MoeForCausalLM can hold of a mixture-of-experts model; throws naming the rest.
inline void check_qwen3_moe(const Llama3Args& a) {
  const MoEArgs& m = *a.moe();
  DTENSOR_MODEL_CHECK(a.qk_norm(),
                      "export_hf: a mixture-of-experts model is written as "
                      "Qwen3MoeForCausalLM, whose attention has q / k norms: set qk_norm");
  DTENSOR_MODEL_CHECK(
      m.score_func() == MoEScore::Softmax && m.num_shared_experts() == 0 &&
          m.route_scale() == 1.0 && m.num_expert_groups() == 1,
      "export_hf: Qwen3MoeForCausalLM routes by softmax over all experts with no shared "
      "experts, groups or route scale; this model has ",
      m.score_func() == MoEScore::Softmax ? "softmax" : "sigmoid", " scores, ",
      m.num_shared_experts(), " shared experts, ", m.num_expert_groups(), " groups, route scale ",
      m.route_scale());
}

// A number of a config's object, or `fallback` when absent or null.
inline double number_or(const nlohmann::json& j, const char* key, double fallback) {
  return j.contains(key) && !j[key].is_null() ? j[key].get<double>() : fallback;
}

// YaRN's keys (Hugging Face's _compute_yarn_parameters): factor and
// original_max_position_embeddings required, beta_fast 32 and beta_slow 1 by default, mscale /
// mscale_all_dim absent unless given; an explicit attention_factor or truncate false refused.
inline void yarn_from_hf(const nlohmann::json& rope, const std::string& path, Llama3Args& a) {
  DTENSOR_MODEL_CHECK(rope.contains("factor") && rope.contains("original_max_position_embeddings"),
                      "load_hf: ", path,
                      ": yarn rope scaling without factor or "
                      "original_max_position_embeddings: ",
                      rope.dump());
  DTENSOR_MODEL_CHECK(number_or(rope, "attention_factor", 0.0) == 0.0 &&
                          rope.value("truncate", true),
                      "load_hf: ", path,
                      ": yarn's attention_factor and truncate are not "
                      "supported: ",
                      rope.dump());
  a.rope_scaling(std::nullopt)
      .yarn(YarnRope()
                .factor(rope.at("factor"))
                .original_max_position_embeddings(rope.at("original_max_position_embeddings"))
                .beta_fast(number_or(rope, "beta_fast", 32.0))
                .beta_slow(number_or(rope, "beta_slow", 1.0))
                .mscale(number_or(rope, "mscale", 0.0))
                .mscale_all_dim(number_or(rope, "mscale_all_dim", 0.0)));
}

// The rotary base and scaling of a config.json: transformers 5's rope_parameters, or the
// older rope_theta / rope_scaling keys.
inline void rope_from_hf(const nlohmann::json& c, const std::string& path, Llama3Args& a) {
  nlohmann::json rope = c.contains("rope_scaling") ? c["rope_scaling"] : nlohmann::json();
  double theta = c.value("rope_theta", 10000.0);
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    const nlohmann::json& p = c["rope_parameters"];
    theta = p.value("rope_theta", theta);
    if (p.value("rope_type", "default") != "default") {
      rope = p;
    }
  }
  a.rope_theta(theta);
  if (rope.is_object() && rope.value("rope_type", rope.value("type", "")) == "llama3") {
    a.rope_scaling(
        Llama3RopeScaling()
            .scaling_factor(rope.at("factor"))
            .low_freq_factor(rope.at("low_freq_factor"))
            .high_freq_factor(rope.at("high_freq_factor"))
            .original_max_position_embeddings(rope.at("original_max_position_embeddings")));
  } else if (rope.is_object() && rope.value("rope_type", rope.value("type", "")) == "yarn") {
    yarn_from_hf(rope, path, a);
  } else {
    DTENSOR_MODEL_CHECK(rope.is_null() ||
                            (rope.is_object() && rope.value("rope_type", "") == "default"),
                        "load_hf: ", path, ": unsupported rope scaling ", rope.dump());
    a.rope_scaling(std::nullopt);
  }
}

// The first of `keys` that config.json has (transformers writes some keys under other names
// than the Hub's configs: num_local_experts for num_experts); throws naming them and the file.
inline const nlohmann::json& config_value(const nlohmann::json& c, const std::string& path,
                                          std::initializer_list<const char*> keys) {
  std::string names;
  for (const char* k : keys) {
    if (c.contains(k) && !c[k].is_null()) {
      return c[k];
    }
    names += names.empty() ? k : std::string(" / ") + k;
  }
  DTENSOR_MODEL_CHECK(false, "load_hf: ", path, " has no ", names);
  return c; // unreachable
}

// A Qwen3-MoE config's experts: moe_intermediate_size, num_experts, num_experts_per_tok,
// norm_topk_prob; its MLP-only layers must be the first ones, every later layer sparse.
inline void moe_from_hf(const nlohmann::json& c, const std::string& path, Llama3Args& a) {
  DTENSOR_MODEL_CHECK(c.value("decoder_sparse_step", int64_t{1}) == 1, "load_hf: ", path,
                      ": decoder_sparse_step ", c.value("decoder_sparse_step", int64_t{1}),
                      " is not supported (MoE layers must follow the dense ones)");
  const std::vector<int64_t> dense = c.value("mlp_only_layers", std::vector<int64_t>{});
  for (size_t i = 0; i < dense.size(); ++i) {
    DTENSOR_MODEL_CHECK(dense[i] == static_cast<int64_t>(i), "load_hf: ", path,
                        ": mlp_only_layers must be the first layers (0, 1, ...), not ",
                        c["mlp_only_layers"].dump());
  }
  a.n_dense_layers(static_cast<int64_t>(dense.size()))
      .moe(MoEArgs()
               .hidden_dim(config_value(c, path, {"moe_intermediate_size"}))
               .num_experts(config_value(c, path, {"num_experts", "num_local_experts"}))
               .top_k(config_value(c, path, {"num_experts_per_tok"}))
               .route_norm(c.value("norm_topk_prob", false))
               .score_func(MoEScore::Softmax));
}

// DeepseekV3ForCausalLM's keys: multi-head latent attention, and a sigmoid-scored MoE with
// node-limited groups, the correction bias and shared experts after first_k_dense_replace
// dense layers. Its config.json's head_dim (transformers derives it: the rotary width) is not
// a head's width and is not read.
inline void deepseek_from_hf(const nlohmann::json& c, const std::string& path, Llama3Args& a) {
  DTENSOR_MODEL_CHECK(c.value("rope_interleave", true), "load_hf: ", path,
                      ": rope_interleave false is not supported (DeepSeek-V3's checkpoints "
                      "rotate interleaved pairs)");
  DTENSOR_MODEL_CHECK(c.value("num_key_value_heads", a.n_heads()) == a.n_heads(), "load_hf: ", path,
                      ": num_key_value_heads ", c.value("num_key_value_heads", a.n_heads()),
                      " differs from num_attention_heads ", a.n_heads(),
                      " (latent attention has no key-value groups)");
  DTENSOR_MODEL_CHECK(c.value("scoring_func", std::string("sigmoid")) == "sigmoid",
                      "load_hf: ", path, ": scoring_func ", c.value("scoring_func", std::string()),
                      " is not DeepSeek-V3's sigmoid");
  const int64_t q_lora = c.contains("q_lora_rank") && !c["q_lora_rank"].is_null()
                             ? c["q_lora_rank"].get<int64_t>()
                             : 0;
  a.attention_head_dim(0).qk_norm(false).mla(
      MLAArgs()
          .q_lora_rank(q_lora)
          .kv_lora_rank(config_value(c, path, {"kv_lora_rank"}))
          .qk_nope_head_dim(config_value(c, path, {"qk_nope_head_dim"}))
          .qk_rope_head_dim(config_value(c, path, {"qk_rope_head_dim"}))
          .v_head_dim(config_value(c, path, {"v_head_dim"})));
  const int64_t dense = c.value("first_k_dense_replace", int64_t{3});
  if (dense >= a.n_layers()) {
    return; // every layer dense
  }
  const int64_t experts = config_value(c, path, {"n_routed_experts"});
  const int64_t groups = c.value("n_group", int64_t{1});
  DTENSOR_MODEL_CHECK(groups >= 1 && experts % groups == 0 &&
                          (groups == 1 || experts / groups >= 2),
                      "load_hf: ", path, ": ", experts, " experts in ", groups,
                      " groups: each group needs at least two");
  a.n_dense_layers(dense).moe(MoEArgs()
                                  .hidden_dim(config_value(c, path, {"moe_intermediate_size"}))
                                  .num_experts(experts)
                                  .top_k(config_value(c, path, {"num_experts_per_tok"}))
                                  .num_shared_experts(c.value("n_shared_experts", int64_t{1}))
                                  .score_func(MoEScore::Sigmoid)
                                  .num_expert_groups(groups)
                                  .num_limited_groups(c.value("topk_group", groups))
                                  .route_norm(c.value("norm_topk_prob", true))
                                  .route_scale(c.value("routed_scaling_factor", 1.0)));
}

// What DeepseekV3ForCausalLM can hold of a model with latent attention; throws naming the rest.
inline void check_deepseek_v3(const Llama3Args& a) {
  if (!a.moe()) {
    return;
  }
  const MoEArgs& m = *a.moe();
  const int64_t per_group = m.num_experts() / m.num_expert_groups();
  DTENSOR_MODEL_CHECK(m.score_func() == MoEScore::Sigmoid && m.num_shared_experts() >= 1 &&
                          (m.num_expert_groups() == 1 || per_group >= 2),
                      "export_hf: DeepseekV3ForCausalLM routes by sigmoid scores with shared "
                      "experts and groups of at least two experts; this model has ",
                      m.score_func() == MoEScore::Softmax ? "softmax" : "sigmoid", " scores, ",
                      m.num_shared_experts(), " shared experts, ", per_group, " per group");
}

// DeepseekV3ForCausalLM's config keys of a model with latent attention.
inline void deepseek_config(const Llama3Args& a, nlohmann::json& c) {
  check_deepseek_v3(a);
  const MLAArgs& l = *a.mla();
  c["architectures"] = {"DeepseekV3ForCausalLM"};
  c["model_type"] = "deepseek_v3";
  c.erase("head_dim");
  c.erase("mlp_bias");
  c["num_key_value_heads"] = a.n_heads();
  c["q_lora_rank"] = l.q_lora_rank() > 0 ? nlohmann::json(l.q_lora_rank()) : nlohmann::json();
  c["kv_lora_rank"] = l.kv_lora_rank();
  c["qk_nope_head_dim"] = l.qk_nope_head_dim();
  c["qk_rope_head_dim"] = l.qk_rope_head_dim();
  c["v_head_dim"] = l.v_head_dim();
  c["rope_interleave"] = true;
  c["num_nextn_predict_layers"] = 0;
  c["first_k_dense_replace"] = a.moe() ? a.n_dense_layers() : a.n_layers();
  if (a.moe()) {
    const MoEArgs& m = *a.moe();
    c["moe_intermediate_size"] = m.hidden_dim();
    c["n_routed_experts"] = m.num_experts();
    c["num_experts_per_tok"] = m.top_k();
    c["n_shared_experts"] = m.num_shared_experts();
    c["n_group"] = m.num_expert_groups();
    c["topk_group"] = m.num_limited_groups();
    c["norm_topk_prob"] = m.route_norm();
    c["routed_scaling_factor"] = m.route_scale();
  }
}

} // namespace llama3_detail

// config.json for Hugging Face's LlamaForCausalLM, or Qwen3ForCausalLM (with qk_norm), or
// Qwen3MoeForCausalLM (with moe), or DeepseekV3ForCausalLM (with mla): transformers' keys.
inline nlohmann::json hf_config(const Llama3Args& a, c10::ScalarType dtype) {
  nlohmann::json rope = nullptr;
  if (a.rope_scaling()) {
    const Llama3RopeScaling& s = *a.rope_scaling();
    rope = {{"rope_type", "llama3"},
            {"factor", s.scaling_factor()},
            {"low_freq_factor", s.low_freq_factor()},
            {"high_freq_factor", s.high_freq_factor()},
            {"original_max_position_embeddings", s.original_max_position_embeddings()}};
  }
  if (a.yarn()) {
    const YarnRope& y = *a.yarn();
    rope = {{"rope_type", "yarn"},
            {"factor", y.factor()},
            {"original_max_position_embeddings", y.original_max_position_embeddings()},
            {"beta_fast", y.beta_fast()},
            {"beta_slow", y.beta_slow()}};
    if (y.mscale() != 0.0) {
      rope["mscale"] = y.mscale();
    }
    if (y.mscale_all_dim() != 0.0) {
      rope["mscale_all_dim"] = y.mscale_all_dim();
    }
  }
  nlohmann::json c = {{"architectures", {"LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"hidden_size", a.dim()},
                      {"intermediate_size", a.ffn_hidden_dim()},
                      {"num_hidden_layers", a.n_layers()},
                      {"num_attention_heads", a.n_heads()},
                      {"num_key_value_heads", a.kv_heads()},
                      {"head_dim", a.head_dim()},
                      {"vocab_size", a.vocab_size()},
                      {"max_position_embeddings", a.max_seq_len()},
                      {"rms_norm_eps", a.norm_eps()},
                      {"rope_theta", a.rope_theta()},
                      {"rope_scaling", rope},
                      {"hidden_act", "silu"},
                      {"attention_bias", false},
                      {"mlp_bias", false},
                      {"tie_word_embeddings", false},
                      {"torch_dtype", dtype == at::kBFloat16 ? "bfloat16" : "float32"}};
  if (a.mla()) {
    llama3_detail::deepseek_config(a, c);
  } else if (a.moe()) {
    llama3_detail::check_qwen3_moe(a);
    const MoEArgs& m = *a.moe();
    std::vector<int64_t> dense;
    for (int64_t i = 0; i < std::min(a.n_dense_layers(), a.n_layers()); ++i) {
      dense.push_back(i);
    }
    c["architectures"] = {"Qwen3MoeForCausalLM"};
    c["model_type"] = "qwen3_moe";
    c["moe_intermediate_size"] = m.hidden_dim();
    c["num_experts"] = m.num_experts();
    c["num_experts_per_tok"] = m.top_k();
    c["norm_topk_prob"] = m.route_norm();
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = dense;
  } else if (a.qk_norm()) {
    c["architectures"] = {"Qwen3ForCausalLM"};
    c["model_type"] = "qwen3";
  }
  return c;
}

// The model arguments a Hugging Face directory's config.json describes (LlamaForCausalLM,
// Qwen3ForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM). The feed-forward width is taken as
// given (intermediate_size), whatever multiple_of would round it to.
inline Llama3Args args_from_hf(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream f(path);
  DTENSOR_MODEL_CHECK(f.good(), "load_hf: cannot read ", path);
  const nlohmann::json c = nlohmann::json::parse(f);
  const std::string type = c.value("model_type", "");
  DTENSOR_MODEL_CHECK(type == "llama" || type == "qwen3" || type == "qwen3_moe" ||
                          type == "deepseek_v3",
                      "load_hf: ", path, " describes a '", type,
                      "' model, not 'llama', 'qwen3', 'qwen3_moe' or 'deepseek_v3'");
  DTENSOR_MODEL_CHECK(!c.value("tie_word_embeddings", false), "load_hf: ", path,
                      ": tied embeddings are not supported");
  DTENSOR_MODEL_CHECK(!c.value("attention_bias", false), "load_hf: ", path,
                      ": attention biases are not supported");
  const int64_t dim = c.at("hidden_size");
  const int64_t heads = c.at("num_attention_heads");
  const int64_t head_dim =
      c.contains("head_dim") && !c["head_dim"].is_null() && type != "deepseek_v3"
          ? c["head_dim"].get<int64_t>()
          : dim / heads;
  Llama3Args a;
  a.dim(dim)
      .n_layers(c.at("num_hidden_layers"))
      .n_heads(heads)
      .n_kv_heads(c.value("num_key_value_heads", heads))
      .attention_head_dim(head_dim == dim / heads && dim % heads == 0 ? 0 : head_dim)
      .qk_norm(type != "llama")
      .vocab_size(c.at("vocab_size"))
      .multiple_of(1)
      .ffn_dim_multiplier(0.0)
      .norm_eps(c.value("rms_norm_eps", type == "deepseek_v3" ? 1e-6 : 1e-5))
      .max_seq_len(c.value("max_position_embeddings", int64_t{2048}));
  llama3_detail::rope_from_hf(c, path, a);
  if (type == "qwen3_moe") {
    llama3_detail::moe_from_hf(c, path, a);
  } else if (type == "deepseek_v3") {
    llama3_detail::deepseek_from_hf(c, path, a);
  }
  a.ffn_hidden(c.at("intermediate_size"));
  return a;
}

} // namespace dtensor::models
