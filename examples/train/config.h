#pragma once

// The job file of examples/train (docs/recipe.md, "Job files"): TOML as torchtitan reads it,
// its keys standing for flags of the recipe, and torchtitan's `--section.key value` overrides.
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtensor::train {

// One flag a job's keys set: ("training.steps", "--steps", "40").
struct ConfigEntry {
  std::string key; // the key it came from (for errors)
  std::string flag;
  std::string value; // the flag's value ("" for a toggle on, "false" for off)
};

// A job's keys, from a file and then the command line, before they become flags.
struct JobKeys {
  std::vector<std::pair<std::string, std::string>> values; // key, value as text, in order
  std::vector<std::string> ignored; // torchtitan's keys this recipe does not implement
  std::string source;               // the file's path ("" for the command line only)
};

// The keys of the TOML file at `path`. Throws std::invalid_argument naming the file and the
// key: a syntax error (with its line), a key neither this recipe nor torchtitan knows (with
// the section's keys), a value of the wrong type for one of the recipe's keys.
JobKeys read_config(const std::string& path);

// `--section.key[=value]` of the command line (`arg` without the leading dashes, `value`
// the word after it when `arg` has no '='; '-' and '_' are the same in names; a boolean key
// takes no value: `--debug.deterministic`, `--debug.no_deterministic`). Returns how many of
// the command line's words it used (1 or 2). Throws std::invalid_argument for a key nobody
// knows.
int add_key_override(JobKeys& keys, const std::string& arg, const char* next);

// The flags `keys` stand for, torchtitan's meaning of the keys that act together applied
// (checkpoint.enable, job.dump_folder, validation.enable: [Note: keys that act together]).
// Throws std::invalid_argument naming the key. A key read but not acted on joins keys.ignored.
std::vector<ConfigEntry> resolve_keys(JobKeys& keys);

// A key's last value, if the job gives it.
using KeyLookup = std::function<std::optional<std::string>(const std::string&)>;

// [Note: a job file's defaults] torchtitan's defaults for the keys a job file leaves out where
// they differ from the flags' (config_keys.cpp).
std::vector<ConfigEntry> torchtitan_file_defaults(const KeyLookup& get);

// model.flavor's value as --preset's: torchtitan's flavor names under model.name ("llama3"
// "8B" -> "llama3-8b"); this recipe's own names as they are. Throws naming model.name when the
// model is none of llama3, qwen3, deepseek_v3.
std::string flavor_name(const std::string& source, const std::string& model,
                        const std::string& flavor);

// The keys of torchtitan's job files this recipe reads without acting on them
// (config_keys.cpp, [Note: torchtitan's keys we do not implement]).
const std::vector<std::string>& torchtitan_only_keys();

// Every key a job file may hold with its flag, by section: for `train --help` and
// docs/recipe.md.
std::vector<std::pair<std::string, std::string>> config_keys();

} // namespace dtensor::train
