#pragma once

// The job file of examples/train (docs/recipe.md, "Configs"): TOML with torchtitan's section
// and key names where the concept is the same, each key standing for one flag of the recipe.
#include <string>
#include <utility>
#include <vector>

namespace dtensor::train {

// One key of a job file and the flag it sets: ("training.steps", "--steps", "40").
struct ConfigEntry {
  std::string key;
  std::string flag;
  std::string value; // the flag's value ("" for a toggle)
};

// The entries of the TOML file at `path` (each table's keys in sorted order). Throws
// std::invalid_argument naming the file and the key: a syntax error (with its line), an unknown key
// (with the section's known keys), a value of the wrong type.
std::vector<ConfigEntry> read_config(const std::string& path);

// Every key a job file may hold, with its flag: for `train --help` and docs/recipe.md.
std::vector<std::pair<std::string, std::string>> config_keys();

} // namespace dtensor::train
