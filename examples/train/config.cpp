// TOML job files and torchtitan's key overrides (config.h), the files read with toml++
// (Debian's libtomlplusplus-dev).
#include "config.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
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
// training.seed / training.deterministic are torchtitan's names before they moved to [debug];
// both are read.
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
      {"model.attn_mask_type",
       "--attn-mask",
       Kind::String,
       {{"block_causal", "documents"}, {"causal", "causal"}}},
      {"optimizer.name", "--optimizer", Kind::String},
      {"optimizer.lr", "--lr", Kind::Number},
      {"optimizer.beta1", "--beta1", Kind::Number},
      {"optimizer.beta2", "--beta2", Kind::Number},
      {"optimizer.eps", "--eps", Kind::Number},
      {"optimizer.weight_decay", "--weight-decay", Kind::Number},
      {"optimizer.muon_momentum", "--muon-momentum", Kind::Number},
      {"optimizer.muon_adjust_lr_fn", "--muon-adjust-lr", Kind::String},
      {"lr_scheduler.warmup_steps", "--warmup-steps", Kind::Int},
      {"lr_scheduler.total_steps", "--lr-total-steps", Kind::Int},
      {"lr_scheduler.decay_ratio", "--decay-ratio", Kind::Number},
      {"lr_scheduler.decay_type", "--decay-type", Kind::String},
      {"lr_scheduler.min_lr_factor", "--min-lr-factor", Kind::Number},
      {"training.steps", "--steps", Kind::Int},
      {"training.seq_len", "--seq", Kind::Int},
      {"training.global_batch_size", "--batch", Kind::Int},
      {"training.local_batch_size", "--local-batch", Kind::Int},
      {"training.max_norm", "--max-norm", Kind::Number},
      {"training.norm_type", "--norm-type", Kind::Number},
      {"training.dataset_path", "--data", Kind::String},
      {"training.data_format", "--data-format", Kind::String},
      {"training.seed", "--seed", Kind::Int},
      {"training.deterministic", "--deterministic", Kind::Bool},
      {"debug.seed", "--seed", Kind::Int},
      {"debug.deterministic", "--deterministic", Kind::Bool},
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
      {"parallelism.context_parallel_rotate_method",
       "--cp-method",
       Kind::String,
       {{"allgather", "allgather"}, {"alltoall", "ring"}}},
      {"parallelism.context_parallel_method", "--cp-method", Kind::String},
      // torchtitan's PTRR (processing-time round robin) is the by-cost layout.
      {"parallelism.context_parallel_load_balancer",
       "--cp-balance",
       Kind::String,
       {{"headtail", "headtail"}, {"ptrr", "cost"}}},
      {"parallelism.context_parallel_ulysses_degree", "--cp-ulysses-degree", Kind::Int},
      {"parallelism.pipeline_parallel_degree", "--pp", Kind::Int},
      {"parallelism.expert_parallel_degree", "--ep", Kind::Int},
      {"parallelism.expert_parallel_dispatch", "--ep-dispatch", Kind::String},
      {"parallelism.expert_parallel_capacity_factor", "--ep-capacity-factor", Kind::Number},
      {"parallelism.expert_parallel_overflow", "--ep-overflow", Kind::String},
      {"parallelism.expert_parallel_float8_dispatch", "--ep-float8-dispatch", Kind::Bool},
      {"parallelism.expert_parallel_overlap", "--ep-overlap", Kind::Bool},
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
       {{"async", ""}, {"disabled", "false"}}},
      {"checkpoint.last_save_model_only", "--last-save-model-only", Kind::Bool},
      {"checkpoint.last_save_in_hf", "--last-save-hf", Kind::Bool},
      {"checkpoint.export_dtype", "--export-dtype", Kind::String},
      {"metrics.log_freq", "--log-every", Kind::Int},
      {"metrics.jsonl", "--metrics", Kind::String},
      {"metrics.save_for_all_ranks", "--tensorboard-all-ranks", Kind::Bool},
      {"comm.trace_buf_size", "--flight-recorder-size", Kind::Int},
      {"profiling.profile_freq", "--profile-freq", Kind::Int},
  };
  return k;
}

// [Note: keys that act together] Keys without a flag of their own that change what other keys
// mean, as in torchtitan: checkpoint.enable (false, the default: the [checkpoint] keys take no
// effect; true: checkpoints in job.dump_folder / checkpoint.folder, resumed from the newest
// there, every checkpoint.interval steps, 500 by default), validation.enable (false: no
// validation; true: every validation.freq steps, 10 by default, over validation.steps
// batches, -1 by default: all held-out ones), activation_checkpoint.selective_ac_option
// (with mode "selective", "op": the recipe's selective mode; a number N: full checkpointing
// of every N-th block, torchtitan's default "2"), training.mixed_precision_reduce (float32,
// the only value torchtitan takes), model.name (which model's flavor model.flavor names),
// model.hf_assets_path (the tokenizer's folder, when the job reads a dataset) and
// training.dataset (torchtitan's dataset names, read from training.dataset_path or, for
// c4_test, from torchtitan's tests/assets/c4_test), metrics.enable_tensorboard (true: event
// files in job.dump_folder / metrics.save_tb_folder, "tb" by default, then a folder per run),
// comm.save_traces_folder (the flight records' folder under job.dump_folder, "comm_traces" by
// default: a job file dumps them unless comm.trace_buf_size is 0, as torchtitan's does),
// profiling.enable_profiling (true: traces in job.dump_folder / profiling.save_traces_folder,
// "profile_traces" by default), profiling.enable_memory_snapshot (true: a GPU's memory
// snapshots in job.dump_folder / profiling.save_memory_snapshot_folder, "memory_snapshot"),
// checkpoint.initial_load_path with initial_load_model_only (true, the default: --init-from,
// the model's weights; false: --resume, the whole training state) and initial_load_in_hf
// (true: --init-from-hf, from initial_load_path or else model.hf_assets_path).
const std::vector<std::pair<const char*, Kind>>& compound_keys() {
  static const std::vector<std::pair<const char*, Kind>> k{
      {"checkpoint.enable", Kind::Bool},
      {"checkpoint.initial_load_path", Kind::String},
      {"checkpoint.initial_load_model_only", Kind::Bool},
      {"checkpoint.initial_load_in_hf", Kind::Bool},
      {"job.dump_folder", Kind::String},
      {"validation.enable", Kind::Bool},
      {"activation_checkpoint.selective_ac_option", Kind::String},
      {"training.mixed_precision_reduce", Kind::String},
      {"model.name", Kind::String},
      {"model.hf_assets_path", Kind::String},
      {"training.dataset", Kind::String},
      {"metrics.enable_tensorboard", Kind::Bool},
      {"metrics.save_tb_folder", Kind::String},
      {"comm.save_traces_folder", Kind::String},
      {"profiling.enable_profiling", Kind::Bool},
      {"profiling.save_traces_folder", Kind::String},
      {"profiling.enable_memory_snapshot", Kind::Bool},
      {"profiling.save_memory_snapshot_folder", Kind::String},
  };
  return k;
}

std::string normalize(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

const Key* find_key(const std::string& dotted) {
  for (const Key& k : keys()) {
    if (dotted == k.key) {
      return &k;
    }
  }
  return nullptr;
}

std::optional<Kind> compound_kind(const std::string& dotted) {
  for (const auto& [name, kind] : compound_keys()) {
    if (dotted == name) {
      return kind;
    }
  }
  return std::nullopt;
}

bool torchtitan_only(const std::string& dotted) {
  const auto& t = torchtitan_only_keys();
  return std::find(t.begin(), t.end(), dotted) != t.end();
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
  std::set<std::string> names;
  for (const Key& k : keys()) {
    names.insert(k.key);
  }
  for (const auto& [name, kind] : compound_keys()) {
    names.insert(name);
  }
  std::string out;
  for (const std::string& name : names) {
    if (name.rfind(section, 0) == 0) {
      out += (out.empty() ? "" : ", ") + name;
    }
  }
  return out.empty() ? "none in this section" : out;
}

[[noreturn]] void bad(const std::string& source, const std::string& key, const std::string& why) {
  throw std::invalid_argument((source.empty() ? "" : source + ": ") + key + ": " + why);
}

// The text of a TOML value of kind `kind`, or an error naming the key.
std::string text_of(const std::string& path, const std::string& key, Kind kind,
                    const toml::node& node) {
  switch (kind) {
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
      return *v ? "true" : "false";
    }
    break;
  case Kind::String:
    if (auto v = node.value_exact<std::string>()) {
      return *v;
    }
    break;
  }
  std::ostringstream got;
  got << node.type();
  bad(path, key, std::string("expected ") + kind_name(kind) + ", got a " + got.str());
}

void walk(const std::string& path, const toml::table& table, const std::string& prefix,
          JobKeys& out) {
  for (auto&& [name, node] : table) {
    const std::string dotted = prefix + std::string(name.str());
    if (const toml::table* sub = node.as_table()) {
      walk(path, *sub, dotted + ".", out);
      continue;
    }
    if (const Key* k = find_key(dotted)) {
      out.values.emplace_back(dotted, text_of(path, dotted, k->kind, node));
    } else if (const std::optional<Kind> kind = compound_kind(dotted)) {
      out.values.emplace_back(dotted, text_of(path, dotted, *kind, node));
    } else if (torchtitan_only(dotted)) {
      out.ignored.push_back(dotted);
    } else {
      bad(path, dotted, "unknown key (known: " + section_keys(dotted) + ")");
    }
  }
}

// The flag value of `text` for `k`: strings translated, a boolean "" (on) or "false".
std::string flag_value(const std::string& source, const Key& k, const std::string& text) {
  if (k.kind == Kind::Bool) {
    if (text != "true" && text != "false" && !text.empty()) {
      bad(source, k.key, "\"" + text + "\" is not true or false");
    }
    return text == "false" ? "false" : "";
  }
  if (k.values.empty()) {
    return text;
  }
  std::string all;
  for (const auto& [from, to] : k.values) {
    if (text == from) {
      return to;
    }
    all += (all.empty() ? "" : ", ") + std::string("\"") + from + "\"";
  }
  bad(source, k.key, "\"" + text + "\" is not one of " + all);
}

// checkpoint.initial_load_* and last_save_in_hf as torchtitan's CheckpointManager reads them
// ([Note: keys that act together]); with checkpoint.enable only.
std::vector<ConfigEntry> initial_load_entries(const std::string& source, const KeyLookup& get) {
  const bool model_only = get("checkpoint.initial_load_model_only") != "false";
  const bool hf = get("checkpoint.initial_load_in_hf") == "true";
  if (get("checkpoint.last_save_in_hf") == "true" &&
      get("checkpoint.last_save_model_only") == "false") {
    bad(source, "checkpoint.last_save_in_hf",
        "true requires last_save_model_only true (Hugging Face's files hold a model only)");
  }
  if (hf && !model_only) {
    bad(source, "checkpoint.initial_load_in_hf",
        "true requires initial_load_model_only true (Hugging Face's files hold a model only)");
  }
  const std::optional<std::string> path = get("checkpoint.initial_load_path");
  if (hf) {
    const std::optional<std::string> dir = path ? path : get("model.hf_assets_path");
    if (!dir) {
      bad(source, "checkpoint.initial_load_in_hf",
          "true needs checkpoint.initial_load_path or model.hf_assets_path (the folder)");
    }
    return {{"checkpoint.initial_load_in_hf", "--init-from-hf", *dir}};
  }
  if (!path) {
    return {};
  }
  return {{"checkpoint.initial_load_path", model_only ? "--init-from" : "--resume", *path}};
}

std::string joined(const std::string& folder, const std::string& name) {
  if (folder.empty() || name.rfind('/', 0) == 0) {
    return name;
  }
  return folder.back() == '/' ? folder + name : folder + "/" + name;
}

} // namespace

JobKeys read_config(const std::string& path) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    std::ostringstream why;
    why << path << ":" << e.source().begin.line << ": " << e.description();
    throw std::invalid_argument(why.str());
  }
  JobKeys out;
  out.source = path;
  walk(path, table, "", out);
  return out;
}

int add_key_override(JobKeys& keys, const std::string& arg, const char* next) {
  const size_t eq = arg.find('=');
  std::string name = normalize(arg.substr(0, eq));
  std::optional<std::string> value;
  if (eq != std::string::npos) {
    value = arg.substr(eq + 1);
  }
  const size_t dot = name.rfind('.');
  std::optional<Kind> kind;
  if (const Key* k = find_key(name)) {
    kind = k->kind;
  } else {
    kind = compound_kind(name);
  }
  // A boolean's "no_" form: --debug.no_deterministic.
  if (!kind && dot != std::string::npos && name.compare(dot + 1, 3, "no_") == 0) {
    const std::string positive = name.substr(0, dot + 1) + name.substr(dot + 4);
    const Key* k = find_key(positive);
    const std::optional<Kind> c = k ? std::optional<Kind>(k->kind) : compound_kind(positive);
    if (c == Kind::Bool && !value) {
      keys.values.emplace_back(positive, "false");
      return 1;
    }
  }
  if (!kind) {
    if (!torchtitan_only(name)) {
      bad("", "--" + name, "unknown key (known: " + section_keys(name) + ")");
    }
    keys.ignored.push_back(name);
    // Its type is not known here: a following word that is not a flag is its value.
    return value || next == nullptr || std::string(next).rfind("--", 0) == 0 ? 1 : 2;
  }
  if (*kind == Kind::Bool && !value) {
    keys.values.emplace_back(name, "true");
    return 1;
  }
  if (value) {
    keys.values.emplace_back(name, *value);
    return 1;
  }
  if (next == nullptr) {
    bad("", "--" + name, "needs a value");
  }
  keys.values.emplace_back(name, next);
  return 2;
}

namespace {

// activation_checkpoint.mode and selective_ac_option as flags: "selective" with "op" the
// recipe's selective mode, with a number N full checkpointing of every N-th block (0 as 1:
// torchtitan checkpoints every block then).
std::vector<ConfigEntry> ac_entries(const std::string& source, const std::string& mode,
                                    const std::string& option) {
  const std::string key = "activation_checkpoint.mode";
  if (mode != "selective" || option == "op") {
    return {{key, "--ac", mode}};
  }
  const bool digits =
      !option.empty() && option.find_first_not_of("0123456789") == std::string::npos;
  if (!digits || option.size() > 6) {
    bad(source, "activation_checkpoint.selective_ac_option",
        "\"" + option + "\" is neither \"op\" nor a block frequency (a number)");
  }
  const int64_t every = std::max<int64_t>(1, std::stoll(option));
  return {{key, "--ac", "full"},
          {"activation_checkpoint.selective_ac_option", "--ac-every", std::to_string(every)}};
}

// training.dataset as --data / --data-format: torchtitan's text datasets are JSON lines of a
// "text" field; c4_test is read from torchtitan's tests/assets/c4_test (relative to the
// working directory, as torchtitan reads it) unless training.dataset_path says where.
std::vector<ConfigEntry> dataset_entries(const std::string& source, const std::string& name,
                                         const std::optional<std::string>& path) {
  const std::string key = "training.dataset";
  if (name != "c4_test" && name != "c4" && name != "c4_validation") {
    bad(source, key,
        "\"" + name +
            "\" is not one of torchtitan's text datasets (c4_test, c4, "
            "c4_validation); give training.dataset_path with training.data_format");
  }
  if (!path && name != "c4_test") {
    bad(source, key,
        "\"" + name +
            "\" is streamed from the Hugging Face Hub by torchtitan; "
            "give training.dataset_path (its JSON-lines files or their folder)");
  }
  return {{key, "--data-format", "jsonl"}, {key, "--data", path.value_or("tests/assets/c4_test")}};
}

} // namespace

std::vector<ConfigEntry> resolve_keys(JobKeys& keys) {
  std::map<std::string, std::string> last; // the value each key ends with
  for (const auto& [key, value] : keys.values) {
    last[key] = value;
  }
  auto get = [&](const std::string& key) -> std::optional<std::string> {
    const auto it = last.find(key);
    return it == last.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  const bool file = !keys.source.empty();
  const bool checkpoints = get("checkpoint.enable") == "true";
  const bool validation = get("validation.enable") == "true";
  // torchtitan's defaults for what a job file leaves out, first, so its own keys override them.
  std::vector<ConfigEntry> out = file ? torchtitan_file_defaults(get) : std::vector<ConfigEntry>{};
  for (const auto& [key, value] : keys.values) {
    const Key* k = find_key(key);
    if (k == nullptr || key == "activation_checkpoint.mode") {
      continue; // keys that act together: below
    }
    if (key.rfind("checkpoint.", 0) == 0 && !checkpoints) {
      continue;
    }
    if (key.rfind("validation.", 0) == 0 && !validation) {
      continue;
    }
    std::string v = flag_value(keys.source, *k, value);
    if (key == "checkpoint.folder") {
      v = joined(get("job.dump_folder").value_or("./outputs"), v);
    } else if (key == "model.flavor") {
      v = flavor_name(keys.source, get("model.name").value_or("llama3"), v);
    }
    out.push_back({key, k->flag, v});
  }
  if (checkpoints) { // torchtitan's defaults for what the job left out, before its own keys
    std::vector<ConfigEntry> defaults{{"checkpoint.enable", "--auto-resume", ""}};
    if (!get("checkpoint.folder")) {
      defaults.push_back({"checkpoint.folder", "--save",
                          joined(get("job.dump_folder").value_or("./outputs"), "checkpoint")});
    }
    if (!get("checkpoint.interval")) {
      defaults.push_back({"checkpoint.interval", "--save-every", "500"});
    }
    if (file && !get("checkpoint.last_save_model_only")) {
      defaults.push_back({"checkpoint.last_save_model_only", "--last-save-model-only", ""});
    }
    out.insert(out.begin(), defaults.begin(), defaults.end());
    const auto initial = initial_load_entries(keys.source, get);
    out.insert(out.end(), initial.begin(), initial.end());
  }
  if (get("metrics.enable_tensorboard") == "true") {
    out.push_back({"metrics.enable_tensorboard", "--tensorboard",
                   joined(get("job.dump_folder").value_or("./outputs"),
                          get("metrics.save_tb_folder").value_or("tb"))});
  }
  if (get("profiling.enable_profiling") == "true") {
    out.push_back({"profiling.enable_profiling", "--profile",
                   joined(get("job.dump_folder").value_or("./outputs"),
                          get("profiling.save_traces_folder").value_or("profile_traces"))});
  }
  if (get("profiling.enable_memory_snapshot") == "true") {
    out.push_back({"profiling.enable_memory_snapshot", "--memory-snapshot",
                   joined(get("job.dump_folder").value_or("./outputs"),
                          get("profiling.save_memory_snapshot_folder").value_or("memory_snapshot"))});
  }
  if (get("comm.trace_buf_size").value_or("1") != "0" &&
      (file || get("comm.save_traces_folder"))) {
    out.push_back({"comm.save_traces_folder", "--flight-recorder",
                   joined(get("job.dump_folder").value_or("./outputs"),
                          get("comm.save_traces_folder").value_or("comm_traces"))});
  }
  if (validation) {
    std::vector<ConfigEntry> defaults;
    if (!get("validation.freq")) {
      defaults.push_back({"validation.freq", "--val-every", "10"});
    }
    if (!get("validation.steps")) {
      defaults.push_back({"validation.steps", "--val-steps", "-1"});
    }
    out.insert(out.begin(), defaults.begin(), defaults.end());
  }
  if (const auto reduce = get("training.mixed_precision_reduce"); reduce && *reduce != "float32") {
    bad(keys.source, "training.mixed_precision_reduce",
        "\"" + *reduce + "\" is not \"float32\" (gradients are reduced in fp32)");
  }
  // torchtitan's mode "selective" checkpoints every 2nd block unless the option says "op";
  // its default mode (a job file's) is "selective".
  if (const auto mode = file ? get("activation_checkpoint.mode").value_or("selective")
                             : get("activation_checkpoint.mode")) {
    const auto ac = ac_entries(keys.source, *mode,
                               get("activation_checkpoint.selective_ac_option").value_or("2"));
    out.insert(out.end(), ac.begin(), ac.end());
  }
  const std::optional<std::string> dataset = get("training.dataset");
  if (dataset) {
    const auto data = dataset_entries(keys.source, *dataset, get("training.dataset_path"));
    out.insert(out.begin(), data.begin(), data.end());
  }
  // The tokenizer of a job that reads a dataset (the built-in paragraph has its own).
  if (const auto assets = get("model.hf_assets_path"); assets && !get("model.tokenizer_path")) {
    if (dataset || get("training.dataset_path")) {
      out.push_back({"model.hf_assets_path", "--tokenizer", *assets});
    } else if (!checkpoints || get("checkpoint.initial_load_in_hf") != "true") {
      keys.ignored.push_back("model.hf_assets_path (no dataset: the built-in paragraph's own)");
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> config_keys() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Key& k : keys()) {
    out.emplace_back(k.key, k.flag);
  }
  for (const auto& [name, kind] : compound_keys()) {
    out.emplace_back(name, "");
  }
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.first.substr(0, a.first.find('.')) < b.first.substr(0, b.first.find('.'));
  });
  return out;
}

} // namespace dtensor::train
