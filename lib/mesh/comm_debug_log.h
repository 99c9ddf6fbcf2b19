#pragma once

// What a CommDebugMode scope holds (lib/mesh/comm_debug_mode.cpp records collectives into it,
// lib/mesh/comm_debug_modules.cpp the module tracking and its views).
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <dtensor/comm_debug_mode.h>

#include "mesh/comm_debug.h"

namespace dtensor {

namespace detail {

// A module as the scope first saw it run ([Note: module attribution]).
struct ModuleSeen {
  std::string type;
  int depth = 0;
  std::vector<std::pair<std::string, std::string>> param_placements; // DTensor parameters
  std::set<std::string> parents; // the modules running when it first ran, itself and "Global"
};

// PyTorch's _CommModeModuleTracker, one per scope.
struct ModuleLog {
  std::string current = "Global";           // where collectives and operations are attributed
  std::vector<std::string> stack{"Global"}; // modules whose forward runs (PyTorch's parent_list)
  bool recomputing = false; // a module's forward runs inside backward (activation checkpointing)
  std::vector<std::string> order{"Global"}; // modules in the order they first ran
  std::map<std::string, ModuleSeen> modules{{"Global", ModuleSeen{}}};
  std::map<std::string, std::vector<std::string>> children; // in call order, repeats kept
  std::map<std::string, std::map<std::string, at::Tensor>> parameters;
  std::map<std::string, std::string> sharding; // "module.param" -> placements
  // Per collective record (same index): the module it is attributed to, and whether it ran
  // in backward.
  std::vector<std::pair<std::string, bool>> attribution;
  std::vector<std::pair<std::string, OpRecord>> operations; // module, DTensor operation
};

} // namespace detail

struct CommDebugMode::Log {
  std::mutex mutex;
  std::vector<CollectiveRecord> records;
  detail::ModuleLog modules;
};

namespace detail {
// The logs of the scopes active on this thread, outermost first.
std::vector<std::shared_ptr<CommDebugMode::Log>> active_logs();
} // namespace detail

} // namespace dtensor
