#pragma once

// torchtitan's Llama3StateDictAdapter for the Llama-3 model: Hugging Face LlamaForCausalLM
// names and rotary layout (to_hf / from_hf), and a directory that
// transformers' LlamaForCausalLM.from_pretrained loads (config.json, model.safetensors.index.json
// and the weights in one safetensors file, full tensors under Hugging Face's names, q / k
// rows in its rotary layout), and the reverse, into a model on any layout.
//
//   dtensor::models::export_hf(model, "out/hf");        // collective; rank 0 writes
//   dtensor::models::load_hf(model, "out/hf");          // collective; each rank reads its shards
//
// [Note: Hugging Face export] The weights go through dtensor::checkpoint: every rank saves
// its own chunks under Hugging Face's names (a DCP-layout checkpoint in a hidden sibling
// directory), then rank 0 consolidates them into one file with config.json beside it and
// publishes the directory atomically. No rank ever holds more than its shards and, on rank 0,
// one full tensor at a time. Loading reads Hugging Face's files as a checkpoint whose chunks
// are whole tensors: each rank reads only the rows of its own shards.
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <dtensor/checkpoint.h>
#include <dtensor/collectives.h>
#include <dtensor/process_group.h>
#include <dtensor/state_dict.h>

#include <models/check.h>
#include <models/llama3/args.h>
#include <models/llama3/model.h>

namespace dtensor::models {

// ---------------------------------------------------------------------------------------------
// Names and layouts (full tensors, no I/O)
// ---------------------------------------------------------------------------------------------

// (ours, Hugging Face's) for the parameters of block i, below "layers.{i}." and
// "model.layers.{i}." (convert_llama_weights_to_hf.py, torchtitan's Llama3StateDictAdapter).
inline const std::vector<std::pair<std::string, std::string>>& hf_block_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"attention.wq.weight", "self_attn.q_proj.weight"},
      {"attention.wk.weight", "self_attn.k_proj.weight"},
      {"attention.wv.weight", "self_attn.v_proj.weight"},
      {"attention.wo.weight", "self_attn.o_proj.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
      {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"},
      {"attention_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
  };
  return names;
}

inline const std::vector<std::pair<std::string, std::string>>& hf_top_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"tok_embeddings.weight", "model.embed_tokens.weight"},
      {"norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  return names;
}

namespace llama3_detail {

inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// `name` mapped by the tables: top-level names directly, "<from_prefix>{i}.<rest>" to
// "<to_prefix>{i}.<rest mapped>"; nullopt when nothing matches. `forward` picks the direction.
inline std::optional<std::string> map_name(const std::string& name, bool forward) {
  for (const auto& [ours, hf] : hf_top_names()) {
    if (name == (forward ? ours : hf)) {
      return forward ? hf : ours;
    }
  }
  const std::string from_prefix = forward ? "layers." : "model.layers.";
  const std::string to_prefix = forward ? "model.layers." : "layers.";
  if (name.rfind(from_prefix, 0) != 0) {
    return std::nullopt;
  }
  const size_t dot = name.find('.', from_prefix.size());
  if (dot == std::string::npos) {
    return std::nullopt;
  }
  const std::string index = name.substr(from_prefix.size(), dot - from_prefix.size());
  const std::string rest = name.substr(dot + 1);
  for (const auto& [ours, hf] : hf_block_names()) {
    if (rest == (forward ? ours : hf)) {
      return to_prefix + index + "." + (forward ? hf : ours);
    }
  }
  return std::nullopt;
}

} // namespace llama3_detail

// Our parameter name -> LlamaForCausalLM's ("layers.3.attention.wq.weight" ->
// "model.layers.3.self_attn.q_proj.weight"). Throws for names without one (freqs_cis).
inline std::string hf_name(const std::string& ours) {
  std::optional<std::string> hf = llama3_detail::map_name(ours, /*forward=*/true);
  DTENSOR_MODEL_CHECK(hf.has_value(), "hf_name: no Hugging Face name for '", ours, "'");
  return *hf;
}

// LlamaForCausalLM's parameter name -> ours. Throws for names without one.
inline std::string from_hf_name(const std::string& hf) {
  std::optional<std::string> ours = llama3_detail::map_name(hf, /*forward=*/false);
  DTENSOR_MODEL_CHECK(ours.has_value(), "from_hf_name: no Llama3 name for '", hf, "'");
  return *ours;
}

// [Note: Hugging Face rotary layout] Hugging Face's rotate_half pairs feature i of a head with
// i + head_dim / 2, not 2i with 2i+1 ([Note: interleaved rotary layout]). to_hf_qk is
// convert_llama_weights_to_hf.py's permute (rows [n_heads, head_dim / 2, 2] -> [n_heads, 2,
// head_dim / 2]), from_hf_qk its inverse; `n_heads`: n_heads for wq, n_kv_heads for wk.
// Full (unsharded) weights [n_heads * head_dim, dim].
inline at::Tensor to_hf_qk(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  DTENSOR_MODEL_CHECK(rows % (2 * n_heads) == 0, "to_hf_qk: ", rows, " rows are not ", n_heads,
              " heads of even size");
  return w.reshape({n_heads, rows / n_heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols});
}

inline at::Tensor from_hf_qk(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  DTENSOR_MODEL_CHECK(rows % (2 * n_heads) == 0, "from_hf_qk: ", rows, " rows are not ", n_heads,
              " heads of even size");
  return w.reshape({n_heads, 2, rows / n_heads / 2, cols}).transpose(1, 2).reshape({rows, cols});
}

// One entry of our state dict as Hugging Face's (name, tensor): wq / wk permuted, the rest as
// is; nullopt for freqs_cis ([Note: freqs_cis is persistent]). Full tensors.
inline std::optional<std::pair<std::string, at::Tensor>>
to_hf(const std::string& name, const at::Tensor& t, const Llama3Args& args) {
  if (name == "freqs_cis") {
    return std::nullopt;
  }
  at::Tensor v = t;
  if (llama3_detail::ends_with(name, ".attention.wq.weight")) {
    v = to_hf_qk(t, args.n_heads());
  } else if (llama3_detail::ends_with(name, ".attention.wk.weight")) {
    v = to_hf_qk(t, args.kv_heads());
  }
  return std::make_pair(hf_name(name), v);
}

// One entry of a Hugging Face state dict as ours; nullopt for rotary_emb.inv_freq (older
// checkpoints' buffer, dropped as torchtitan's adapter does).
inline std::optional<std::pair<std::string, at::Tensor>>
from_hf(const std::string& hf, const at::Tensor& t, const Llama3Args& args) {
  if (llama3_detail::ends_with(hf, ".self_attn.rotary_emb.inv_freq")) {
    return std::nullopt;
  }
  at::Tensor v = t;
  if (llama3_detail::ends_with(hf, ".self_attn.q_proj.weight")) {
    v = from_hf_qk(t, args.n_heads());
  } else if (llama3_detail::ends_with(hf, ".self_attn.k_proj.weight")) {
    v = from_hf_qk(t, args.kv_heads());
  }
  return std::make_pair(from_hf_name(hf), v);
}

// ---------------------------------------------------------------------------------------------
// Export and load
// ---------------------------------------------------------------------------------------------


// config.json for LlamaForCausalLM (transformers' LlamaConfig keys).
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
  return {{"architectures", {"LlamaForCausalLM"}},
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
}

// The model arguments a Hugging Face directory's config.json describes. The feed-forward
// width is taken as given (intermediate_size), whatever multiple_of would round it to.
inline Llama3Args args_from_hf(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream f(path);
  DTENSOR_MODEL_CHECK(f.good(), "load_hf: cannot read ", path);
  const nlohmann::json c = nlohmann::json::parse(f);
  DTENSOR_MODEL_CHECK(c.value("model_type", "") == "llama", "load_hf: ", path, " describes a '",
              c.value("model_type", ""), "' model, not 'llama'");
  DTENSOR_MODEL_CHECK(!c.value("tie_word_embeddings", false), "load_hf: ", path,
              ": tied embeddings are not supported");
  const int64_t dim = c.at("hidden_size");
  const int64_t heads = c.at("num_attention_heads");
  DTENSOR_MODEL_CHECK(c.value("head_dim", dim / heads) == dim / heads, "load_hf: ", path,
              ": head_dim must be hidden_size / num_attention_heads");
  Llama3Args a;
  a.dim(dim)
      .n_layers(c.at("num_hidden_layers"))
      .n_heads(heads)
      .n_kv_heads(c.value("num_key_value_heads", heads))
      .vocab_size(c.at("vocab_size"))
      .multiple_of(1)
      .ffn_dim_multiplier(0.0)
      .norm_eps(c.value("rms_norm_eps", 1e-5))
      .rope_theta(c.value("rope_theta", 10000.0))
      .max_seq_len(c.value("max_position_embeddings", int64_t{2048}));
  const nlohmann::json& rope = c.contains("rope_scaling") ? c["rope_scaling"] : nlohmann::json();
  if (rope.is_object() && rope.value("rope_type", rope.value("type", "")) == "llama3") {
    a.rope_scaling(
        Llama3RopeScaling()
            .scaling_factor(rope.at("factor"))
            .low_freq_factor(rope.at("low_freq_factor"))
            .high_freq_factor(rope.at("high_freq_factor"))
            .original_max_position_embeddings(rope.at("original_max_position_embeddings")));
  } else {
    DTENSOR_MODEL_CHECK(rope.is_null(), "load_hf: ", path, ": unsupported rope_scaling ", rope.dump());
    a.rope_scaling(std::nullopt);
  }
  a.ffn_hidden(c.at("intermediate_size"));
  return a;
}

// Writes `model` (any layout) as a Hugging Face LlamaForCausalLM directory `dir`, its
// tensors in their current dtype. Collective over all ranks.
inline void export_hf(Llama3& model, const std::string& dir) {
  torch::NoGradGuard no_grad;
  const Llama3Args& args = model->model_args;
  dtensor::StateDict hf;
  c10::ScalarType dtype = at::kFloat;
  for (const auto& item : dtensor::get_model_state_dict(*model)) {
    if (auto entry = to_hf(item.key(), item.value(), args)) {
      dtype = entry->second.scalar_type();
      hf.insert(entry->first, entry->second);
    }
  }
  // What is at `dir` is checked before anything is written (docs/checkpoint.md); the
  // sharded parts go to a sibling, consolidated by rank 0, then removed.
  const std::string what = "export_hf(" + dir + ")";
  dtensor::on_rank0(what, [&] { dtensor::checkpoint::check_target(dir); }, dtensor::world_group());
  const std::string parts = dir + ".dtensor-parts";
  dtensor::checkpoint::save(hf, parts, dtensor::checkpoint::SaveOptions().checksums(false));
  dtensor::on_rank0(
      what,
      [&] {
        try {
          dtensor::checkpoint::consolidate(parts, dir,
                                           dtensor::checkpoint::ConsolidateOptions().extra_files(
                                               {{"config.json", hf_config(args, dtype).dump(2)}}));
        } catch (...) {
          dtensor::checkpoint::remove(parts);
          throw;
        }
        dtensor::checkpoint::remove(parts);
      },
      dtensor::world_group());
}

// Loads a Hugging Face LlamaForCausalLM directory into `model` (any layout; its arguments
// must match config.json's), each rank reading only its own shards. Collective.
inline void load_hf(Llama3& model, const std::string& dir) {
  torch::NoGradGuard no_grad;
  const Llama3Args& args = model->model_args;
  dtensor::StateDict state = dtensor::get_model_state_dict(*model);
  dtensor::StateDict reads;          // Hugging Face's names -> tensors laid out as ours
  std::vector<std::string> permuted; // our names of q / k weights, read into temporaries
  for (const auto& item : state) {
    if (item.key() == "freqs_cis") {
      continue;
    }
    const bool qk = llama3_detail::ends_with(item.key(), ".attention.wq.weight") ||
                    llama3_detail::ends_with(item.key(), ".attention.wk.weight");
    reads.insert(hf_name(item.key()), qk ? at::empty_like(item.value()) : item.value());
    if (qk) {
      permuted.push_back(item.key());
    }
  }
  dtensor::checkpoint::load(reads, dir);
  for (const std::string& key : permuted) {
    auto entry = from_hf(hf_name(key), reads[hf_name(key)], args);
    state[key] = entry->second;
  }
  state["freqs_cis"].copy_(model->compute_freqs_cis(state["freqs_cis"].options()));
  dtensor::set_model_state_dict(*model, state);
}

} // namespace dtensor::models
