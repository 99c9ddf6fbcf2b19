// TOML job files (config.h) through toml++ (Debian's libtomlplusplus-dev).
#include "config.h"

#include <cstdint>
#include <sstream>
#include <stdexcept>

#include <toml++/toml.h>

namespace dtensor::train {

namespace {

enum class Kind { Int, Number, String, Bool };

// A key: its flag, the TOML type it takes, and for strings a translation of torchtitan's
// values to the flag's ("bfloat16" -> "bf16"); empty: taken as it is.
struct Key {
  const char* key;
  const char* flag;
  Kind kind;
  std::vector<std::pair<const char*, const char*>> values = {};
};

// [Note: torchtitan's job file] Section and key names are torchtitan's JobConfig where the
// concept is the same (training.steps, parallelism.tensor_parallel_degree, ...); the model's
// shape is the flavor's ModelArgs names under [model]; what torchtitan has no key for keeps
// the flag's name (pipeline_parallel_microbatches counts microbatches, torchtitan sizes them).
const std::vector<Key>& keys() {
  static const std::vector<Key> k{
      {"model.flavor", "--preset", Kind::String},
      {"model.dim", "--dim", Kind::Int},
      {"model.n_layers", "--layers", Kind::Int},
      {"model.n_heads", "--heads", Kind::Int},
      {"model.n_kv_heads", "--kv-heads", Kind::Int},
      {"model.vocab_size", "--vocab", Kind::Int},
      {"model.tokenizer_path", "--tokenizer", Kind::String},
      {"model.num_experts", "--experts", Kind::Int},
      {"optimizer.lr", "--lr", Kind::Number},
      {"training.steps", "--steps", Kind::Int},
      {"training.seq_len", "--seq", Kind::Int},
      {"training.global_batch_size", "--batch", Kind::Int},
      {"training.max_norm", "--max-norm", Kind::Number},
      {"training.dataset_path", "--data", Kind::String},
      {"training.data_format", "--data-format", Kind::String},
      {"validation.freq", "--val-every", Kind::Int},
      {"validation.steps", "--val-steps", Kind::Int},
      {"training.mixed_precision_param",
       "--precision",
       Kind::String,
       {{"bfloat16", "bf16"}, {"float32", "fp32"}}},
      {"parallelism.data_parallel_replicate_degree", "--dp-replicate", Kind::Int},
      {"parallelism.data_parallel_shard_degree", "--dp-shard", Kind::Int},
      {"parallelism.tensor_parallel_degree", "--tp", Kind::Int},
      {"parallelism.context_parallel_degree", "--cp", Kind::Int},
      {"parallelism.context_parallel_rotate_method", "--cp-method", Kind::String},
      {"parallelism.pipeline_parallel_degree", "--pp", Kind::Int},
      {"parallelism.expert_parallel_degree", "--ep", Kind::Int},
      {"parallelism.pipeline_parallel_schedule", "--pp-schedule", Kind::String},
      {"parallelism.pipeline_parallel_microbatches", "--microbatches", Kind::Int},
      {"activation_checkpoint.mode", "--ac", Kind::String},
      {"quantize.linear.float8.recipe_name", "--float8", Kind::String},
      {"quantize.linear.float8.enable_fsdp_float8_all_gather", "--float8-all-gather", Kind::Bool},
      {"checkpoint.folder", "--save", Kind::String},
      {"checkpoint.interval", "--save-every", Kind::Int},
      {"checkpoint.keep_latest_k", "--keep-latest", Kind::Int},
      {"checkpoint.async_mode",
       "--async-save",
       Kind::String,
       {{"async", ""}, {"disabled", nullptr}}},
      {"checkpoint.initial_load_path", "--resume", Kind::String},
      {"metrics.log_freq", "--log-every", Kind::Int},
      {"metrics.jsonl", "--metrics", Kind::String},
  };
  return k;
}

const char* kind_name(Kind k) {
  switch (k) {
  case Kind::Int:
    return "an integer";
  case Kind::Number:
    return "a number";
  case Kind::String:
    return "a string";
  case Kind::Bool:
    return "true or false";
  }
  return "?";
}

std::string section_keys(const std::string& dotted) {
  const std::string section = dotted.substr(0, dotted.rfind('.') + 1);
  std::string out;
  for (const Key& k : keys()) {
    if (std::string(k.key).rfind(section, 0) == 0) {
      out += (out.empty() ? "" : ", ") + std::string(k.key);
    }
  }
  return out.empty() ? "none in this section" : out;
}

[[noreturn]] void bad(const std::string& path, const std::string& key, const std::string& why) {
  throw std::invalid_argument(path + ": " + key + ": " + why);
}

// The flag value of `node` for `k`; nullopt: the key sets nothing (a toggle given false).
std::optional<std::string> value_of(const std::string& path, const Key& k, const toml::node& node) {
  switch (k.kind) {
  case Kind::Int:
    if (auto v = node.value_exact<int64_t>()) {
      return std::to_string(*v);
    }
    break;
  case Kind::Number:
    if (node.is_number()) {
      std::ostringstream s;
      s.precision(17);
      s << *node.value<double>();
      return s.str();
    }
    break;
  case Kind::Bool:
    if (auto v = node.value_exact<bool>()) {
      return *v ? std::optional<std::string>("") : std::nullopt;
    }
    break;
  case Kind::String:
    if (auto v = node.value_exact<std::string>()) {
      if (k.values.empty()) {
        return *v;
      }
      std::string all;
      for (const auto& [from, to] : k.values) {
        if (*v == from) {
          return to == nullptr ? std::nullopt : std::optional<std::string>(to);
        }
        all += (all.empty() ? "" : ", ") + std::string("\"") + from + "\"";
      }
      bad(path, k.key, "\"" + *v + "\" is not one of " + all);
    }
    break;
  }
  std::ostringstream got;
  got << node.type();
  bad(path, k.key, std::string("expected ") + kind_name(k.kind) + ", got a " + got.str());
}

void walk(const std::string& path, const toml::table& table, const std::string& prefix,
          std::vector<ConfigEntry>& out) {
  for (auto&& [name, node] : table) {
    const std::string dotted = prefix + std::string(name.str());
    if (const toml::table* sub = node.as_table()) {
      walk(path, *sub, dotted + ".", out);
      continue;
    }
    const Key* found = nullptr;
    for (const Key& k : keys()) {
      if (dotted == k.key) {
        found = &k;
      }
    }
    if (found == nullptr) {
      bad(path, dotted, "unknown key (known: " + section_keys(dotted) + ")");
    }
    if (auto v = value_of(path, *found, node)) {
      out.push_back({dotted, found->flag, *v});
    }
  }
}

} // namespace

std::vector<ConfigEntry> read_config(const std::string& path) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    std::ostringstream why;
    why << path << ":" << e.source().begin.line << ": " << e.description();
    throw std::invalid_argument(why.str());
  }
  std::vector<ConfigEntry> out;
  walk(path, table, "", out);
  return out;
}

std::vector<std::pair<std::string, std::string>> config_keys() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Key& k : keys()) {
    out.emplace_back(k.key, k.flag);
  }
  return out;
}

} // namespace dtensor::train
