// CommDebugMode per module: the tracker the module scopes report to, and PyTorch's views of it
// (comm_module_counts, the tracing table, the JSON dump, sharding and parameter info).
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/graph_task.h>

#include "internal/check.h"
#include "mesh/comm_debug_log.h"

namespace dtensor {

// [Note: module attribution]
// PyTorch's CommDebugMode tracks modules with global module hooks (its _CommModeModuleTracker
// on ModTracker). C++ modules have none: a module is seen when it is called through the
// module seam, whose attribution hooks (lib/parallel/seam/attribution.cpp) report here; the
// rules are PyTorch's, so the same model gives the same counts per module:
//  - a module's forward makes it the current module; its end makes its caller current again
//    (a forward run inside autograd's backward, activation checkpointing's recompute, makes
//    the module current and changes nothing else, as PyTorch's tracker does);
//  - the gradient of one of its outputs arriving in backward makes it current;
//  - a collective counts for the current module and for every module that was running when
//    the current one first ran ("Global" always), under "backward" when autograd's engine is
//    running a backward on the issuing thread, "forward" otherwise;
//  - the modules seen, their depth, type and parameters are those of their first forward
//    (type and parameters: of their last forward outside backward).
// Tensor parallelism's output conversions happen when a module's scope ends (PyTorch's
// forward hook), so they count for that module, as in PyTorch.

namespace detail {

bool in_autograd_backward() { return torch::autograd::get_current_graph_task_id() != -1; }

void module_forward_begin(const ModuleForward& m) {
  const bool recompute = in_autograd_backward();
  for (const auto& log : active_logs()) {
    std::lock_guard<std::mutex> lock(log->mutex);
    ModuleLog& t = log->modules;
    t.current = m.name;
    t.recomputing = recompute;
    if (recompute) {
      continue;
    }
    if (t.modules.count(m.name) == 0) {
      t.order.push_back(m.name);
      ModuleSeen seen;
      seen.parents = std::set<std::string>(t.stack.begin(), t.stack.end());
      seen.parents.insert(m.name);
      t.modules[m.name] = std::move(seen);
    }
    ModuleSeen& seen = t.modules[m.name];
    seen.type = m.type;
    seen.depth = static_cast<int>(t.stack.size());
    seen.param_placements.clear();
    for (const auto& [name, placements, tensor] : m.parameters) {
      t.parameters[m.name][name] = tensor;
      if (!placements.empty()) {
        seen.param_placements.emplace_back(name, placements);
        t.sharding[m.name + "." + name] = placements;
      }
    }
    t.children[t.stack.back()].push_back(m.name);
    t.stack.push_back(m.name);
  }
}

void module_forward_end() {
  const bool recompute = in_autograd_backward();
  for (const auto& log : active_logs()) {
    std::lock_guard<std::mutex> lock(log->mutex);
    ModuleLog& t = log->modules;
    t.recomputing = recompute;
    if (recompute || t.stack.size() <= 1) {
      continue;
    }
    t.stack.pop_back();
    t.current = t.stack.back();
  }
}

void module_backward_begin(const std::string& name) {
  for (const auto& log : active_logs()) {
    std::lock_guard<std::mutex> lock(log->mutex);
    log->modules.current = name;
    log->modules.recomputing = false;
  }
}

void record_dtensor_op(OpRecord op) {
  op.is_bw = in_autograd_backward();
  for (const auto& log : active_logs()) {
    std::lock_guard<std::mutex> lock(log->mutex);
    OpRecord mine = op;
    mine.is_activation_checkpointing = log->modules.recomputing;
    log->modules.operations.emplace_back(log->modules.current, std::move(mine));
  }
}

} // namespace detail

namespace {

using detail::ModuleLog;
using detail::OpRecord;

// The names PyTorch's CommDebugMode gives the collectives (its functional collectives).
std::string torch_name(CollectiveKind kind) {
  switch (kind) {
  case CollectiveKind::AllReduce:
    return "c10d_functional.all_reduce";
  case CollectiveKind::AllGather:
    return "c10d_functional.all_gather_into_tensor";
  case CollectiveKind::ReduceScatter:
    return "c10d_functional.reduce_scatter_tensor";
  case CollectiveKind::AllToAll:
    return "c10d_functional.all_to_all_single";
  case CollectiveKind::Broadcast:
    return "c10d_functional.broadcast";
  case CollectiveKind::Barrier:
    return "c10d.barrier";
  case CollectiveKind::Send: // PyTorch's CommDebugMode does not count point-to-point
    return "c10d.send";
  case CollectiveKind::Recv:
    return "c10d.recv_";
  }
  return "?";
}

// One module's collectives in first-seen order (PyTorch's dicts keep insertion order).
using Ordered = std::vector<std::pair<CollectiveKind, int64_t>>;
struct PassCounts {
  Ordered forward, backward;
};

void add(Ordered& counts, CollectiveKind kind) {
  for (auto& [k, n] : counts) {
    if (k == kind) {
      ++n;
      return;
    }
  }
  counts.emplace_back(kind, 1);
}

std::map<std::string, PassCounts> module_counts(const std::vector<CollectiveRecord>& records,
                                                const ModuleLog& t) {
  std::map<std::string, PassCounts> out{{"Global", {}}};
  for (size_t i = 0; i < records.size() && i < t.attribution.size(); ++i) {
    const auto& [name, backward] = t.attribution[i];
    auto count = [&](const std::string& m) {
      PassCounts& c = out[m];
      add(backward ? c.backward : c.forward, records[i].kind);
    };
    count(name);
    if (auto it = t.modules.find(name); it != t.modules.end()) {
      for (const auto& parent : it->second.parents) {
        if (parent != name) {
          count(parent);
        }
      }
    }
  }
  return out;
}

// PyTorch's _set_noise_parameters.
struct Noise {
  bool dtensor_ops, module_data, ops, trivial_ops;
  explicit Noise(int level)
      : dtensor_ops(level > 0), module_data(level > 0), ops(level > 1), trivial_ops(level > 2) {}
};

bool is_trivial(const std::string& op) {
  static const std::set<std::string> trivial{
      "aten.detach.default",        "aten.t.default",         "aten.view.default",
      "aten._to_copy.default",      "aten.as_strided.default", "aten.transpose.int"};
  return trivial.count(op) != 0;
}

// Whether the noise level lists an operation (PyTorch's filters; dtensor records DTensor
// operations only, so levels 1 and 2 list the same).
bool shown(const OpRecord& op, const Noise& noise) {
  return noise.trivial_ops || ((noise.ops || !op.input_shape.empty()) && !is_trivial(op.name));
}

// The operations of one module by pass (forward, backward, checkpointing), all of them from
// noise level 1 on (a pass is listed when it has any, as in PyTorch, even if none is shown).
std::array<std::vector<const OpRecord*>, 3> module_ops(const ModuleLog& t, const std::string& name,
                                                       const Noise& noise) {
  std::array<std::vector<const OpRecord*>, 3> out;
  if (!noise.dtensor_ops) {
    return out;
  }
  for (const auto& [module, op] : t.operations) {
    if (module == name) {
      out[op.is_activation_checkpointing ? 2 : op.is_bw ? 1 : 0].push_back(&op);
    }
  }
  return out;
}

std::vector<const OpRecord*> shown_only(const std::vector<const OpRecord*>& ops, const Noise& noise) {
  std::vector<const OpRecord*> out;
  for (const OpRecord* op : ops) {
    if (shown(*op, noise)) {
      out.push_back(op);
    }
  }
  return out;
}

std::string py_list(const std::vector<std::string>& items) {
  return fmt::format("[{}]", fmt::join(items, ", "));
}

std::string tracing_lines(const Ordered& collectives, const std::vector<const OpRecord*>& ops,
                          const std::string& collective_indent, const std::string& op_indent) {
  std::string out;
  for (const auto& [kind, n] : collectives) {
    out += fmt::format("\033[1;33m{}*{}: {}\033[0m\n", collective_indent, torch_name(kind), n);
  }
  for (const OpRecord* op : ops) {
    out += fmt::format("\033[1;33m{}**{}\033[0m\n", collective_indent, op->name);
    if (!op->input_shape.empty()) {
      out += fmt::format("\033[1;31m{}shape: {}\033[0m\n", op_indent, py_list(op->input_shape));
      out += fmt::format("\033[1;31m{}sharding: {}\033[0m\n", op_indent, py_list(op->input_sharding));
      out += fmt::format("\033[1;31m{}device mesh: {}\033[0m\n", op_indent, op->device_mesh);
    }
  }
  return out;
}

nlohmann::ordered_json ops_json(const std::vector<const OpRecord*>& ops) {
  auto out = nlohmann::ordered_json::array();
  for (const OpRecord* op : ops) {
    nlohmann::ordered_json j;
    j["name"] = op->name;
    j["input_shape"] = op->input_shape;
    j["input_sharding"] = op->input_sharding;
    j["device_mesh"] = op->device_mesh;
    j["is_bw"] = op->is_bw;
    j["is_activation_checkpointing"] = op->is_activation_checkpointing;
    out.push_back(std::move(j));
  }
  return out;
}

nlohmann::ordered_json collectives_json(const Ordered& counts) {
  auto out = nlohmann::ordered_json::array();
  for (const auto& [kind, n] : counts) {
    out.push_back({torch_name(kind), n});
  }
  return out;
}

nlohmann::ordered_json module_json(const ModuleLog& t, const std::map<std::string, PassCounts>& counts,
                                   const std::string& name, const Noise& noise, int depth) {
  DTENSOR_CHECK(depth < 256, "CommDebugMode::json_dump: module nesting deeper than 256 at '{}'", name);
  nlohmann::ordered_json j;
  j["fqn"] = name;
  j["module_type"] = "";
  j["parameters"] = nlohmann::ordered_json::array();
  j["children"] = nlohmann::ordered_json::array();
  j["collectives_forward"] = nlohmann::ordered_json::array();
  j["collectives_backward"] = nlohmann::ordered_json::array();
  const auto& seen = t.modules.at(name);
  if (noise.module_data && name != "Global") {
    j["module_type"] = seen.type;
    for (const auto& [param, placements] : seen.param_placements) {
      j["parameters"].push_back({param, placements});
    }
  }
  if (auto c = counts.find(name); c != counts.end()) {
    j["collectives_forward"] = collectives_json(c->second.forward);
    j["collectives_backward"] = collectives_json(c->second.backward);
  }
  const auto ops = module_ops(t, name, noise);
  j["operations_forward"] = ops_json(shown_only(ops[0], noise));
  j["operations_backward"] = ops_json(shown_only(ops[1], noise));
  j["operations_checkpointing"] = ops_json(shown_only(ops[2], noise));
  if (auto ch = t.children.find(name); ch != t.children.end()) {
    for (const auto& child : ch->second) {
      j["children"].push_back(module_json(t, counts, child, noise, depth + 1));
    }
  }
  return j;
}

// Written into a hidden sibling of `path` named for this process (never a file of the
// user's) and renamed over it: a reader never sees half a file. A directory at `path` is an
// error; a symbolic link there is replaced by the file (what it points to is untouched).
void write_file(const std::string& what, const std::string& path, const std::string& text) {
  const std::filesystem::path p(path);
  const std::string tmp =
      (p.parent_path() / fmt::format(".{}.dtensor-tmp-{}", p.filename().string(), ::getpid())).string();
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    DTENSOR_CHECK(f.good(), "CommDebugMode::{}: cannot open '{}' for writing: {} (writing {})",
                  what, path, std::strerror(errno), tmp);
    f << text;
    f.close();
    if (!f.good()) {
      std::remove(tmp.c_str());
      DTENSOR_FAIL("CommDebugMode::{}: writing '{}' failed (a full disk?)", what, path);
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string error = std::strerror(errno);
    std::remove(tmp.c_str());
    DTENSOR_FAIL("CommDebugMode::{}: cannot replace '{}': {}", what, path, error);
  }
}

} // namespace

std::map<std::string, CommDebugMode::ModuleCollectives> CommDebugMode::comm_module_counts() const {
  std::lock_guard<std::mutex> lock(log_->mutex);
  std::map<std::string, ModuleCollectives> out;
  for (const auto& [name, pass] : module_counts(log_->records, log_->modules)) {
    ModuleCollectives& m = out[name];
    for (const auto& [kind, n] : pass.forward) {
      m.forward[kind] = n;
    }
    for (const auto& [kind, n] : pass.backward) {
      m.backward[kind] = n;
    }
  }
  return out;
}

std::string CommDebugMode::generate_comm_debug_tracing_table(int noise_level) const {
  std::lock_guard<std::mutex> lock(log_->mutex);
  const ModuleLog& t = log_->modules;
  const Noise noise(noise_level);
  const auto counts = module_counts(log_->records, t);
  std::string table;
  for (const auto& name : t.order) {
    const auto& seen = t.modules.at(name);
    std::string indent(static_cast<size_t>(4 * seen.depth), ' ');
    table += indent + name + "\n";
    if (noise.module_data && name != "Global") {
      table += fmt::format("{}*module type: {}\n", indent, seen.type);
      if (!seen.param_placements.empty()) {
        table += indent + "*Parameter List\n";
        for (const auto& [param, placements] : seen.param_placements) {
          table += fmt::format("{} *{}: {}\n", indent, param, placements);
        }
      }
    }
    indent += "  ";
    const std::string collective_indent(static_cast<size_t>(4 * seen.depth + 4), ' ');
    const std::string op_indent(static_cast<size_t>(4 * seen.depth + 6), ' ');
    const PassCounts none;
    const auto it = counts.find(name);
    const PassCounts& c = it == counts.end() ? none : it->second;
    const auto ops = module_ops(t, name, noise);
    const char* passes[] = {"FORWARD PASS", "BACKWARD PASS", "ACTIVATION CHECKPOINTING"};
    const Ordered* collectives[] = {&c.forward, &c.backward, nullptr};
    for (size_t p = 0; p < 3; ++p) {
      if ((collectives[p] && !collectives[p]->empty()) || !ops[p].empty()) {
        table += indent + passes[p] + "\n" +
                 tracing_lines(collectives[p] ? *collectives[p] : Ordered{},
                               shown_only(ops[p], noise), collective_indent, op_indent);
      }
    }
  }
  return table;
}

void CommDebugMode::log_comm_debug_tracing_table_to_file(const std::string& file_name,
                                                         int noise_level) const {
  static const std::regex ansi("\x1B\\[[0-?]*[ -/]*[@-~]");
  write_file("log_comm_debug_tracing_table_to_file", file_name,
             std::regex_replace(generate_comm_debug_tracing_table(noise_level), ansi, ""));
}

std::string CommDebugMode::json_dump(int noise_level) const {
  std::lock_guard<std::mutex> lock(log_->mutex);
  const auto counts = module_counts(log_->records, log_->modules);
  return module_json(log_->modules, counts, "Global", Noise(noise_level), 0).dump(4);
}

void CommDebugMode::generate_json_dump(const std::string& file_name, int noise_level) const {
  write_file("generate_json_dump", file_name, json_dump(noise_level));
}

std::map<std::string, std::string> CommDebugMode::get_sharding_info() const {
  std::lock_guard<std::mutex> lock(log_->mutex);
  return log_->modules.sharding;
}

std::map<std::string, std::map<std::string, at::Tensor>> CommDebugMode::get_parameter_info() const {
  std::lock_guard<std::mutex> lock(log_->mutex);
  return log_->modules.parameters;
}

} // namespace dtensor
