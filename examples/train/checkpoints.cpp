// The recipe's checkpoint folder and metrics file (checkpoints.h).
#include "checkpoints.h"

#include "llama_flags.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include <dtensor/checkpoint.h>
#include <dtensor/collectives.h>
#include <dtensor/error.h>
#include <dtensor/process_group.h>

namespace dtensor::train {

namespace fs = std::filesystem;

namespace {

// N for a name "step-<N>", else nothing.
std::optional<int64_t> step_of(const std::string& name) {
  const std::string prefix = "step-";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      !std::all_of(name.begin() + prefix.size(), name.end(), ::isdigit) || name.size() > 20) {
    return std::nullopt;
  }
  return std::stoll(name.substr(prefix.size()));
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// What a save into root/step-<N> leaves beside it while in progress or after being killed.
bool save_leftover(const std::string& name) {
  return name.rfind(".step-", 0) == 0 &&
         (ends_with(name, ".dtensor-tmp") || ends_with(name, ".dtensor-lock"));
}

// The complete checkpoints under `root`, by step.
std::map<int64_t, fs::path> complete_steps(const fs::path& root) {
  std::map<int64_t, fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    return out;
  }
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const auto step = step_of(e.path().filename().string());
    if (step && checkpoint::is_complete(e.path().string())) {
      out[*step] = e.path();
    }
  }
  return out;
}

void check_folder(const std::string& root) {
  std::error_code ec;
  const fs::file_status st = fs::status(root, ec);
  if (!fs::exists(st)) {
    return;
  }
  if (!fs::is_directory(st)) {
    throw Error("--save " + root + ": it is a file, not a checkpoint folder; nothing was written");
  }
  std::vector<std::string> foreign;
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    const bool ours =
        step_of(name) ? checkpoint::is_complete(e.path().string()) : save_leftover(name);
    if (!ours) {
      foreign.push_back(name);
    }
  }
  if (foreign.empty()) {
    return;
  }
  std::sort(foreign.begin(), foreign.end());
  std::string shown;
  for (size_t i = 0; i < foreign.size() && i < 4; ++i) {
    shown += (i ? ", " : "") + foreign[i];
  }
  if (foreign.size() > 4) {
    shown += " and " + std::to_string(foreign.size() - 4) + " more";
  }
  throw Error("--save " + root + ": it holds entries this recipe did not write (" + shown +
              "); a checkpoint folder holds only step-<N> checkpoints, so nothing was written. "
              "Choose a new or empty directory");
}

} // namespace

CheckpointFolder::CheckpointFolder(std::string root, int64_t keep_latest)
    : root_(std::move(root)), keep_latest_(keep_latest) {
  on_rank0(
      "the recipe's checkpoint folder", [&] { check_folder(root_); }, world_group());
}

std::string CheckpointFolder::step_dir(int64_t step) const {
  return (fs::path(root_) / ("step-" + std::to_string(step))).string();
}

void CheckpointFolder::prune() const {
  if (get_rank() != 0 || keep_latest_ <= 0) {
    return;
  }
  std::map<int64_t, fs::path> steps = complete_steps(root_);
  while (static_cast<int64_t>(steps.size()) > keep_latest_) {
    try {
      checkpoint::remove(steps.begin()->second.string());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "warning: not pruned: %s\n", e.what());
    }
    steps.erase(steps.begin());
  }
}

bool is_hf_folder(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  return fs::is_regular_file(d / "config.json", ec) &&
         (fs::is_regular_file(d / "model.safetensors", ec) ||
          fs::is_regular_file(d / "model.safetensors.index.json", ec));
}

bool holds_train_state(const std::string& dir) {
  if (is_hf_folder(dir)) {
    return false;
  }
  try {
    const std::vector<checkpoint::TensorInfo> infos = checkpoint::read_metadata(dir);
    return std::any_of(infos.begin(), infos.end(),
                       [](const checkpoint::TensorInfo& t) { return t.key == "step"; });
  } catch (const std::exception&) {
    return false; // not a checkpoint load() reads: resume() names why
  }
}

std::string latest_checkpoint(const std::string& path) {
  if (checkpoint::is_complete(path)) {
    return path;
  }
  const std::map<int64_t, fs::path> steps = complete_steps(path);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (holds_train_state(it->second.string())) {
      return it->second.string();
    }
  }
  return "";
}

std::string newest_saved(const std::string& path) {
  if (checkpoint::is_complete(path) || is_hf_folder(path)) {
    return path;
  }
  const std::map<int64_t, fs::path> steps = complete_steps(path);
  return steps.empty() ? path : steps.rbegin()->second.string();
}

void resolve_start(Flags& f) {
  if (f.auto_resume && !f.save.empty()) {
    if (std::string latest = latest_checkpoint(f.save); !latest.empty()) {
      f.resume = latest; // complete ones only: saves are published atomically
    }
  }
  if (!f.resume.empty()) {
    const std::string latest = latest_checkpoint(f.resume);
    f.resume = latest.empty() ? f.resume : latest; // else what load() makes of it (PyTorch's)
    if (checkpoint::is_complete(f.resume) && !holds_train_state(f.resume)) {
      usage("--resume " + f.resume + ": it holds a model only (no optimizer, no step); start "
            "from its weights with --init-from " + f.resume);
    }
  }
  if (f.init_from.empty()) {
    return;
  }
  if (!f.init_from_hf.empty()) {
    usage("give --init-from or --init-from-hf, not both");
  }
  if (!f.resume.empty()) {
    if (get_rank() == 0) {
      std::fprintf(stderr, "warning: --init-from %s not read: resuming from %s\n",
                   f.init_from.c_str(), f.resume.c_str());
    }
    f.init_from.clear();
    return;
  }
  const std::string dir = newest_saved(f.init_from);
  if (is_hf_folder(dir)) {
    f.init_from_hf = dir;
    f.init_from.clear();
  } else {
    f.init_from = dir;
  }
}

namespace {

void check_metrics(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) {
    return;
  }
  if (!fs::is_regular_file(st)) {
    throw Error("--metrics " + path + ": it is not a regular file; nothing was written");
  }
  std::ifstream f(path);
  std::string line;
  for (int64_t n = 1; std::getline(f, line); ++n) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step")) {
      throw Error("--metrics " + path + ": line " + std::to_string(n) +
                  " is not a metrics record (a JSON object with a \"step\"), so the file is not "
                  "one this recipe wrote; nothing was written. Choose another path");
    }
  }
}

} // namespace

std::ofstream open_metrics(const std::string& path, bool append) {
  std::ofstream out;
  on_rank0(
      "the metrics file",
      [&] {
        check_metrics(path);
        const fs::path dir = fs::path(path).parent_path();
        if (!dir.empty()) {
          fs::create_directories(dir);
        }
        errno = 0;
        out.open(path, append ? std::ios::app : std::ios::trunc);
        if (!out) {
          throw Error("--metrics " + path + ": cannot open it for writing" +
                      (errno != 0 ? std::string(" (") + std::strerror(errno) + ")" : ""));
        }
      },
      world_group());
  return out;
}

} // namespace dtensor::train
