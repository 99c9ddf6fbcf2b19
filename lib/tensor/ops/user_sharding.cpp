// register_sharding (include/dtensor/register_sharding.h): user functions as sharding rules.
#include <dtensor/register_sharding.h>

#include <limits>
#include <map>
#include <mutex>

#include <c10/util/accumulate.h>

#include "internal/check.h"
#include "tensor/dispatch/handler.h"
#include "tensor/ops/registry.h"

namespace dtensor {

namespace detail {

namespace {

struct UserRule {
  ShardingFn fn;
  ShardingRule previous = nullptr; // dtensor's rule under the same name, restored on removal
};

std::mutex& user_mutex() {
  static std::mutex m;
  return m;
}

std::map<std::string, UserRule>& user_sharding_fns() {
  static std::map<std::string, UserRule> r;
  return r;
}

ShardingFn find_fn(const OpInfo& info) {
  std::lock_guard<std::mutex> lock(user_mutex());
  auto& r = user_sharding_fns();
  auto it = r.find(std::string(info.name));
  if (it == r.end()) {
    it = r.find(info.op->schema().name());
  }
  DTENSOR_CHECK(it != r.end(), "{}: its register_sharding function is gone", info.name);
  return it->second.fn;
}

void check_lengths(const OpInfo& info, const AcceptableSharding& s, size_t k) {
  const size_t nret = info.op->schema().returns().size();
  DTENSOR_CHECK(s.outputs.size() == nret && s.inputs.size() == info.num_args(),
                "register_sharding for {}: acceptable sharding {} gives {} output and {} input "
                "placements; the op returns {} and takes {} arguments (nullopt for those that "
                "are not tensors)",
                info.name, k, s.outputs.size(), s.inputs.size(), nret, info.num_args());
  for (size_t a = 0; a < info.num_args(); ++a) {
    const bool tensor = info.specs[a].has_value() || !info.list_specs[a].empty();
    DTENSOR_CHECK(!tensor || s.inputs[a].has_value(),
                  "register_sharding for {}: acceptable sharding {} gives no placement for "
                  "DTensor argument {} '{}'",
                  info.name, k, a, info.op->schema().arguments()[a].name());
  }
}

// Whether choice `s` fits argument a (a Shard within its dims).
bool fits(const OpInfo& info, const AcceptableSharding& s) {
  for (size_t a = 0; a < info.num_args(); ++a) {
    if (info.specs[a] && s.inputs[a]->is_shard()) {
      const int64_t d = s.inputs[a]->dim();
      if (d >= info.specs[a]->ndim() || d < -info.specs[a]->ndim()) {
        return false;
      }
    }
  }
  return true;
}

// Elements moved on mesh dim i to bring every input to choice `s` (a proxy for bytes).
double moved_elements(const OpInfo& info, const AcceptableSharding& s, size_t i) {
  double c = 0;
  for (size_t a = 0; a < info.num_args(); ++a) {
    if (info.specs[a]) {
      const DTensorSpec& spec = *info.specs[a];
      if (!(spec.placements[i] == s.inputs[a]->normalized(spec.ndim()))) {
        c += static_cast<double>(c10::multiply_integers(spec.shape));
      }
    }
  }
  return c;
}

// The rule registered under every op with a user function: the cheapest acceptable sharding
// per mesh dim (costs add over mesh dims, so choosing per dim is choosing the combination).
OpSharding user_sharding_rule(const OpInfo& info) {
  ShardingFn fn = find_fn(info);
  ShardingArgs args;
  args.values.assign(info.args.begin(), info.args.end());
  args.specs.reserve(info.specs.size());
  for (const SpecRef& spec : info.specs) {
    args.specs.push_back(spec ? std::optional<DTensorSpec>(*spec) : std::nullopt);
  }
  const std::vector<AcceptableSharding> choices = fn(args);
  for (size_t k = 0; k < choices.size(); ++k) {
    check_lengths(info, choices[k], k);
  }
  const auto n = static_cast<size_t>(info.mesh_ndim());
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.list_inputs.resize(info.num_args());
  s.outputs.assign(info.op->schema().returns().size(), Placements(n, Placement::replicate()));
  for (size_t a = 0; a < info.num_args(); ++a) {
    if (info.specs[a]) {
      s.inputs[a] = Placements(n, Placement::replicate());
    }
    if (!info.list_specs[a].empty()) {
      s.list_inputs[a] = Placements(n, Placement::replicate());
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const AcceptableSharding* best = nullptr;
    double best_cost = std::numeric_limits<double>::infinity();
    for (const auto& c : choices) {
      if (fits(info, c) && moved_elements(info, c, i) < best_cost) {
        best = &c;
        best_cost = moved_elements(info, c, i);
      }
    }
    if (best == nullptr) {
      fail_unsupported(info, fmt::format("none of the {} shardings its register_sharding "
                                         "function accepts fits these inputs",
                                         choices.size()));
    }
    for (size_t a = 0; a < info.num_args(); ++a) {
      if (info.specs[a]) {
        (*s.inputs[a])[i] = best->inputs[a]->normalized(info.specs[a]->ndim());
      } else if (!info.list_specs[a].empty()) {
        (*s.list_inputs[a])[i] = *best->inputs[a];
      }
    }
    for (size_t r = 0; r < s.outputs.size(); ++r) {
      if (best->outputs[r]) {
        s.outputs[r][i] = *best->outputs[r];
      }
    }
  }
  return s;
}

bool op_exists(const std::string& name) {
  const auto dot = name.find('.');
  const std::string base = name.substr(0, dot);
  for (const auto& op : c10::Dispatcher::singleton().getAllOpNames()) {
    if (op.name == base && (dot == std::string::npos || op.overload_name == name.substr(dot + 1))) {
      return true;
    }
  }
  return false;
}

} // namespace

} // namespace detail

void register_sharding(const std::string& op, ShardingFn fn) {
  using namespace detail;
  DTENSOR_CHECK(op_exists(op),
                "register_sharding: no operator named {} (\"ns::name\" or "
                "\"ns::name.overload\"; is the library defining it loaded?)",
                op);
  DTENSOR_CHECK(fn != nullptr, "register_sharding for {}: the function is empty", op);
  {
    std::lock_guard<std::mutex> lock(user_mutex());
    auto& r = user_sharding_fns();
    auto it = r.find(op);
    ShardingRule previous = it != r.end() ? it->second.previous : exact_rule(op);
    r[op] = UserRule{std::move(fn), previous};
  }
  register_rule(op, user_sharding_rule);
  route_to_handler(op);
  clear_decision_cache();
}

void unregister_sharding(const std::string& op) {
  using namespace detail;
  ShardingRule previous = nullptr;
  {
    std::lock_guard<std::mutex> lock(user_mutex());
    auto& r = user_sharding_fns();
    auto it = r.find(op);
    DTENSOR_CHECK(it != r.end(), "unregister_sharding: no function is registered for {}", op);
    previous = it->second.previous;
    r.erase(it);
  }
  if (previous != nullptr) {
    register_rule(op, previous);
  } else {
    unregister_rule(op);
  }
  clear_decision_cache();
}

} // namespace dtensor
