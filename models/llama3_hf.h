#pragma once

// Hugging Face exchange of the Llama-3 model (models/llama3.h): a directory that
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
#include <string>

#include <nlohmann/json.hpp>

#include <dtensor/checkpoint.h>
#include <dtensor/collectives.h>
#include <dtensor/process_group.h>
#include <dtensor/state_dict.h>

#include <models/llama3.h>

namespace dtensor::models {

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
