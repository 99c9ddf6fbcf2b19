#pragma once

// torchtitan's Llama3StateDictAdapter for the Llama-3 model: Hugging Face LlamaForCausalLM
// names and rotary layout (to_hf / from_hf), and a model folder that
// transformers' LlamaForCausalLM.from_pretrained loads (Qwen3ForCausalLM with qk_norm,
// Qwen3MoeForCausalLM with moe: its experts one tensor each, as the Hub's checkpoints)
// (config.json, generation_config.json, the weights in safetensors files with their index,
// full tensors under Hugging Face's names, q / k rows in its rotary layout), and the reverse,
// into a model on any layout.
//
//   dtensor::models::export_hf(model, "out/hf");        // collective; each rank writes its pieces
//   dtensor::models::load_hf(model, "out/hf");          // collective; each rank reads its shards
//
// [Note: Hugging Face export] The weights go through dtensor::checkpoint::save_hf under
// Hugging Face's names: every rank writes the bytes of its own pieces into their places in
// Hugging Face's files, which are published atomically. No rank gathers anything. Loading
// reads Hugging Face's files as a checkpoint whose chunks are whole tensors: each rank reads
// only the rows of its own shards (memory-mapped).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <dtensor/checkpoint.h>
#include <dtensor/collectives.h>
#include <dtensor/process_group.h>
#include <dtensor/state_dict.h>

#include <models/check.h>
#include <models/llama3/args.h>
#include <models/llama3/hf_config.h>
#include <models/llama3/hf_fp8.h>
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
      // Qwen3's q / k norms and a Qwen3-MoE layer's router
      {"attention.q_norm.weight", "self_attn.q_norm.weight"},
      {"attention.k_norm.weight", "self_attn.k_norm.weight"},
      {"moe.router.gate.weight", "mlp.gate.weight"},
      // A Qwen3-MoE layer's experts [E, F, D], stored by Hugging Face as one tensor per
      // expert ([Note: stacked names] in dtensor/checkpoint.h): these names stand for the
      // stacks, hf_expert_pattern gives the stored ones.
      {"moe.experts.w1", "mlp.experts.gate_proj.weight"},
      {"moe.experts.w2", "mlp.experts.down_proj.weight"},
      {"moe.experts.w3", "mlp.experts.up_proj.weight"},
      // DeepSeek-V3's latent attention (its q latent's norm: hf_mla_names), shared experts
      // and load-balancing bias (Hugging Face's e_score_correction_bias)
      {"attention.wq_a.weight", "self_attn.q_a_proj.weight"},
      {"attention.wq_b.weight", "self_attn.q_b_proj.weight"},
      {"attention.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"},
      {"attention.kv_norm.weight", "self_attn.kv_a_layernorm.weight"},
      {"attention.wkv_b.weight", "self_attn.kv_b_proj.weight"},
      {"moe.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"},
      {"moe.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"},
      {"moe.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"},
      {"moe.expert_bias", "mlp.gate.e_score_correction_bias"},
  };
  return names;
}

// Names that mean another Hugging Face name with latent attention, where q_norm is the q
// latent's norm (torchtitan's name), not Qwen3's per-head norm.
inline const std::vector<std::pair<std::string, std::string>>& hf_mla_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"attention.q_norm.weight", "self_attn.q_a_layernorm.weight"},
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

// Our names of the weights Hugging Face holds in its rotary layout.
inline bool is_qk_norm(const std::string& ours) {
  return ends_with(ours, ".attention.q_norm.weight") || ends_with(ours, ".attention.k_norm.weight");
}
inline bool is_rotary(const std::string& ours) {
  return ends_with(ours, ".attention.wq.weight") || ends_with(ours, ".attention.wk.weight") ||
         is_qk_norm(ours);
}

// `name` mapped by the tables: top-level names directly, "<from_prefix>{i}.<rest>" to
// "<to_prefix>{i}.<rest mapped>"; nullopt when nothing matches. `forward` picks the direction;
// `mla`: hf_mla_names first.
inline std::optional<std::string> map_name(const std::string& name, bool forward,
                                           bool mla = false) {
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
  for (const auto* table : {&hf_mla_names(), &hf_block_names()}) {
    if (table == &hf_mla_names() && !mla) {
      continue;
    }
    for (const auto& [ours, hf] : *table) {
      if (rest == (forward ? ours : hf)) {
        return to_prefix + index + "." + (forward ? hf : ours);
      }
    }
  }
  return std::nullopt;
}

} // namespace llama3_detail

// The stored names of a stacked experts' tensor (hf_name of "layers.{i}.moe.experts.w1":
// "model.layers.{i}.mlp.experts.gate_proj.weight" ->
// "model.layers.{i}.mlp.experts.{}.gate_proj.weight"), or nullopt for any other name.
inline std::optional<std::string> hf_expert_pattern(const std::string& hf) {
  const std::string experts = ".mlp.experts.";
  const size_t at = hf.find(experts);
  if (at == std::string::npos) {
    return std::nullopt;
  }
  const std::string rest = hf.substr(at + experts.size());
  if (rest != "gate_proj.weight" && rest != "up_proj.weight" && rest != "down_proj.weight") {
    return std::nullopt;
  }
  return hf.substr(0, at + experts.size()) + "{}." + rest;
}

// Our parameter name -> LlamaForCausalLM's ("layers.3.attention.wq.weight" ->
// "model.layers.3.self_attn.q_proj.weight"); `mla`: a model with latent attention's
// (DeepseekV3ForCausalLM's). Throws for names without one (freqs_cis).
inline std::string hf_name(const std::string& ours, bool mla = false) {
  std::optional<std::string> hf = llama3_detail::map_name(ours, /*forward=*/true, mla);
  DTENSOR_MODEL_CHECK(hf.has_value(), "hf_name: no Hugging Face name for '", ours, "'");
  return *hf;
}

// LlamaForCausalLM's parameter name -> ours. Throws for names without one.
inline std::string from_hf_name(const std::string& hf, bool mla = false) {
  std::optional<std::string> ours = llama3_detail::map_name(hf, /*forward=*/false, mla);
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
// is (with latent attention nothing is permuted: [Note: latent attention] in mla.h); nullopt
// for freqs_cis ([Note: freqs_cis is persistent]). Full tensors.
inline std::optional<std::pair<std::string, at::Tensor>>
to_hf(const std::string& name, const at::Tensor& t, const Llama3Args& args) {
  if (args.mla()) {
    return name == "freqs_cis" ? std::nullopt
                               : std::make_optional(std::make_pair(hf_name(name, true), t));
  }
  if (name == "freqs_cis" || llama3_detail::ends_with(name, ".moe.expert_bias")) {
    return std::nullopt; // the bias: checked zero by export_hf (Qwen3-MoE has none)
  }
  at::Tensor v = t;
  if (llama3_detail::ends_with(name, ".attention.wq.weight")) {
    v = to_hf_qk(t, args.n_heads());
  } else if (llama3_detail::ends_with(name, ".attention.wk.weight")) {
    v = to_hf_qk(t, args.kv_heads());
  } else if (llama3_detail::is_qk_norm(name)) {
    v = to_hf_qk(t.view({-1, 1}), 1).view({-1}); // one head's features, as q's rows
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
  if (args.mla()) {
    return std::make_pair(from_hf_name(hf, true), t);
  }
  at::Tensor v = t;
  if (llama3_detail::ends_with(hf, ".self_attn.q_proj.weight")) {
    v = from_hf_qk(t, args.n_heads());
  } else if (llama3_detail::ends_with(hf, ".self_attn.k_proj.weight")) {
    v = from_hf_qk(t, args.kv_heads());
  } else if (llama3_detail::ends_with(hf, "_norm.weight") &&
             hf.find(".self_attn.") != std::string::npos) {
    v = from_hf_qk(t.view({-1, 1}), 1).view({-1});
  }
  return std::make_pair(from_hf_name(hf), v);
}

// ---------------------------------------------------------------------------------------------
// Export and load
// ---------------------------------------------------------------------------------------------

namespace llama3_detail {
// A Hugging Face state dict in the order of transformers' modules (a block's q, k, v, o,
// q / k norms, router, gate, up, down, then its norms), so that files of a maximum size hold
// the tensors save_pretrained's hold (the experts' stacks excepted). Blocks and the top-level
// names keep their order (embed_tokens, the blocks, norm, lm_head).
inline dtensor::StateDict in_hf_order(const dtensor::StateDict& hf) {
  static const std::vector<std::string> within = {"self_attn.q_proj.",
                                                  "self_attn.q_a_proj.",
                                                  "self_attn.q_a_layernorm.",
                                                  "self_attn.q_b_proj.",
                                                  "self_attn.kv_a_proj_with_mqa.",
                                                  "self_attn.kv_a_layernorm.",
                                                  "self_attn.kv_b_proj.",
                                                  "self_attn.k_proj.",
                                                  "self_attn.v_proj.",
                                                  "self_attn.o_proj.",
                                                  "self_attn.q_norm.",
                                                  "self_attn.k_norm.",
                                                  "mlp.gate.",
                                                  "mlp.experts.gate_proj.",
                                                  "mlp.experts.up_proj.",
                                                  "mlp.experts.down_proj.",
                                                  "mlp.gate_proj.",
                                                  "mlp.up_proj.",
                                                  "mlp.down_proj.",
                                                  "input_layernorm.",
                                                  "post_attention_layernorm."};
  auto rank_of = [](const std::string& name) {
    const std::string prefix = "model.layers.";
    if (name.rfind(prefix, 0) != 0) {
      return within.size();
    }
    const std::string rest = name.substr(name.find('.', prefix.size()) + 1);
    for (size_t i = 0; i < within.size(); ++i) {
      if (rest.rfind(within[i], 0) == 0) {
        return i;
      }
    }
    return within.size();
  };
  // Each name's group (its block, or itself at the top level) in order of first appearance,
  // then its place in the block.
  std::map<std::string, size_t> group_of;
  std::vector<std::tuple<size_t, size_t, std::string, at::Tensor>> items;
  for (const auto& item : hf) {
    const std::string& name = item.key();
    const std::string prefix = "model.layers.";
    const std::string group =
        name.rfind(prefix, 0) == 0 ? name.substr(0, name.find('.', prefix.size())) : name;
    const size_t g = group_of.try_emplace(group, group_of.size()).first->second;
    items.emplace_back(g, rank_of(name), name, item.value());
  }
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a)) < std::tie(std::get<0>(b), std::get<1>(b));
  });
  dtensor::StateDict out;
  for (const auto& [group, place, name, value] : items) {
    out.insert(name, value);
  }
  return out;
}

} // namespace llama3_detail

// What export_hf writes beside the weights and config.json.
struct HfExportOptions {
  using Files = std::map<std::string, std::string>; // name -> content

  // The largest weights file (transformers' max_shard_size; its default, 50 GB).
  TORCH_ARG(int64_t, max_shard_bytes) = 50'000'000'000;
  // Files written as they are, by name: the tokenizer's (tokenizer.json,
  // tokenizer_config.json, special_tokens_map.json, tokenizer.model) and generation_config.json.
  // Without a generation_config.json, one deferring to config.json is written.
  TORCH_ARG(Files, files) = {};
  // The floating tensors converted to this dtype as they are written (torchtitan's
  // checkpoint.export_dtype); none: each in its own.
  TORCH_ARG(std::optional<c10::ScalarType>, dtype) = std::nullopt;
};

// Writes a model's state (get_model_state_dict of the model, or of each of this rank's
// pipeline stages under the whole model's names: every name some rank holds is written) as a
// Hugging Face model folder `dir`, its tensors in their current dtype or options.dtype(): the
// weights in safetensors files of at most max_shard_bytes (several with an index), config.json,
// generation_config.json and the options' files. Every rank writes its own pieces in place
// (checkpoint::save_hf); nothing is gathered. Collective over all ranks.
inline void export_hf(const dtensor::StateDict& state, const Llama3Args& args,
                      const std::string& dir, const HfExportOptions& options = {}) {
  torch::NoGradGuard no_grad;
  if (args.mla()) { // before anything is written
    llama3_detail::check_deepseek_v3(args);
  } else if (args.moe()) {
    llama3_detail::check_qwen3_moe(args);
  }
  dtensor::StateDict hf;
  c10::ScalarType dtype = at::kFloat;
  dtensor::checkpoint::StackedNames unstack; // the experts, one tensor each
  for (const auto& item : state) {
    if (!args.mla() && llama3_detail::ends_with(item.key(), ".moe.expert_bias")) {
      DTENSOR_MODEL_CHECK(!item.value().ne(0).any().item<bool>(), "export_hf: ", item.key(),
                          " is not zero, and Qwen3MoeForCausalLM has no load-balancing bias: its "
                          "routing would differ from this model's");
    }
    if (auto entry = to_hf(item.key(), item.value(), args)) {
      if (options.dtype() && entry->second.is_floating_point()) {
        entry->second = entry->second.to(*options.dtype());
      }
      dtype = entry->second.scalar_type();
      if (auto pattern = hf_expert_pattern(entry->first)) {
        unstack[entry->first] = *pattern;
      }
      hf.insert(entry->first, entry->second);
    }
  }
  hf = llama3_detail::in_hf_order(hf);
  dtensor::checkpoint::HfSaveOptions::Files files = options.files();
  files["config.json"] = hf_config(args, dtype).dump(2);
  files.try_emplace("generation_config.json", R"({"_from_model_config": true})");
  dtensor::checkpoint::save_hf(hf, dir,
                               dtensor::checkpoint::HfSaveOptions()
                                   .max_shard_bytes(options.max_shard_bytes())
                                   .extra_files(files)
                                   .unstack(unstack));
}

// Writes `model` (any layout) as a Hugging Face model folder `dir`, its tensors in their
// current dtype. Collective over all ranks.
inline void export_hf(Llama3& model, const std::string& dir, const HfExportOptions& options = {}) {
  export_hf(dtensor::get_model_state_dict(*model), model->model_args, dir, options);
}

// Reads a Hugging Face LlamaForCausalLM directory into a model's state (any layout; the
// model's arguments must match config.json's; a pipeline stage's names only), each rank
// reading only its own shards, stored floating dtypes converted to the model's: the tensors of
// `state` are written or replaced, freqs_cis left alone. The caller sets the state. Collective.
inline void load_hf(dtensor::StateDict& state, const Llama3Args& args, const std::string& dir) {
  torch::NoGradGuard no_grad;
  dtensor::StateDict reads;                  // Hugging Face's names -> tensors laid out as ours
  std::vector<std::string> permuted;         // our names of q / k weights, read into temporaries
  dtensor::checkpoint::StackedNames stacked; // the experts, one tensor each
  std::vector<std::string> biases;
  for (const auto& item : state) {
    if (item.key() == "freqs_cis") {
      continue;
    }
    const bool mla = args.mla().has_value();
    if (!mla && llama3_detail::ends_with(item.key(), ".moe.expert_bias")) {
      biases.push_back(item.key()); // Qwen3-MoE's model has none: zero after the load
      continue;
    }
    const bool qk = !mla && llama3_detail::is_rotary(item.key());
    const std::string name = hf_name(item.key(), mla);
    reads.insert(name, qk ? at::empty_like(item.value()) : item.value());
    if (qk) {
      permuted.push_back(item.key());
    }
    if (auto pattern = hf_expert_pattern(name)) {
      stacked[name] = *pattern;
    }
  }
  // [Note: float8 block-quantized weights] read first; the rest as stored.
  const dtensor::StateDict rest = load_fp8_weights(reads, stacked, dir);
  std::erase_if(stacked, [&](const auto& entry) { return !rest.contains(entry.first); });
  dtensor::checkpoint::load(
      rest, dir, dtensor::checkpoint::LoadOptions().stacked(stacked).convert_dtype(true));
  for (const std::string& key : permuted) {
    auto entry = from_hf(hf_name(key), reads[hf_name(key)], args);
    state[key] = entry->second;
  }
  for (const std::string& key : biases) {
    state[key].zero_();
  }
}

// Loads a Hugging Face LlamaForCausalLM directory into `model` (any layout; its arguments
// must match config.json's), each rank reading only its own shards. Collective.
inline void load_hf(Llama3& model, const std::string& dir) {
  torch::NoGradGuard no_grad;
  dtensor::StateDict state = dtensor::get_model_state_dict(*model);
  load_hf(state, model->model_args, dir);
  state["freqs_cis"].copy_(model->compute_freqs_cis(state["freqs_cis"].options()));
  dtensor::set_model_state_dict(*model, state);
}

} // namespace dtensor::models
