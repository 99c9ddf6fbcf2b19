#pragma once

// What every save does before it writes (checkpoint.cpp's save and async_save, hf_export.cpp's
// save_hf): the target checked and locked, the write plan, Partial pieces reduced, the
// temporary directory made.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <dtensor/state_dict.h>

#include "checkpoint/layout.h"
#include "checkpoint/target.h"

namespace dtensor::detail {

// Runs `body`, turning a dtensor::Error or filesystem error into the text agree_on_errors takes.
template <class F>
std::string attempt(F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

struct PreparedSave {
  std::string api; // "checkpoint::save", "checkpoint::async_save" ..., for messages
  std::vector<SavedTensor> tensors;
  WritePlan plan;
  Target target;
  std::filesystem::path tmp;
  std::shared_ptr<TargetLock> lock; // rank 0's, until published
};

// Collective over the world; an error (a target that may not be replaced, names the ranks
// disagree on) is raised on every rank before anything is written.
PreparedSave prepare_save(const StateDict& state, const std::string& dir, bool overwrite,
                          const char* api);

} // namespace dtensor::detail
