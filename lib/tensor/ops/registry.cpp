// The sharding-rule registry, the shape-argument table and the helpers rules share.
#include <mutex>
#include <unordered_map>

#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

// A registered rule and how it reads Scalars.
struct Entry {
  ShardingRule rule = nullptr;
  bool scalar_sign_only = false;
};

std::unordered_map<std::string, Entry>& rules() {
  static std::unordered_map<std::string, Entry> r;
  return r;
}

// The entry for "ns::name.overload", else for "ns::name", else none.
const Entry* lookup(const std::string& full_name, const std::string& base_name) {
  auto& r = rules();
  auto it = r.find(full_name);
  if (it == r.end()) {
    it = r.find(base_name);
  }
  return it == r.end() ? nullptr : &it->second;
}

} // namespace

void register_rule(const std::string& name, ShardingRule rule, bool scalar_sign_only) {
  rules()[name] = Entry{rule, scalar_sign_only};
}

bool rule_reads_scalar_sign_only(const std::string& full_name, const std::string& base_name) {
  const Entry* e = lookup(full_name, base_name);
  return e != nullptr && e->scalar_sign_only;
}

ShardingRule find_rule(const std::string& full_name, const std::string& base_name) {
  const Entry* e = lookup(full_name, base_name);
  return e == nullptr ? nullptr : e->rule;
}

ShardingRule exact_rule(const std::string& name) {
  auto it = rules().find(name);
  return it == rules().end() ? nullptr : it->second.rule;
}

void unregister_rule(const std::string& name) {
  rules().erase(name);
}

void register_builtin_rules() {
  register_tensor_ops();
  register_pointwise_ops();
  register_reduction_ops();
  register_matmul_ops();
  register_view_ops();
  register_nn_ops();
  register_attention_ops();
  register_conv_ops();
  register_embedding_ops();
  register_list_ops();
  register_dim_ops();
  register_whole_ops();
  register_random_ops();
}

const ShapeArgs* shape_args_of(const std::string& schema_name) {
  static const std::unordered_map<std::string, ShapeArgs> table = {
      {"aten::view", {1, -1}},           {"aten::_unsafe_view", {1, -1}},
      {"aten::expand", {1, -1}},         {"aten::new_empty", {1, -1}},
      {"aten::new_zeros", {1, -1}},      {"aten::new_ones", {1, -1}},
      {"aten::new_full", {1, -1}},       {"aten::new_empty_strided", {1, 2}},
      {"aten::slice_backward", {1, -1}}, {"aten::select_backward", {1, -1}},
  };
  auto it = table.find(schema_name);
  return it == table.end() ? nullptr : &it->second;
}

OpSharding all_replicate(const OpInfo& info) {
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.list_inputs.resize(info.num_args());
  for (size_t a = 0; a < info.num_args(); ++a) {
    if (info.specs[a]) {
      s.inputs[a] = replicate_all(info.mesh_ndim());
    }
    if (!info.list_specs[a].empty()) {
      s.list_inputs[a] = replicate_all(info.mesh_ndim());
    }
  }
  for (size_t r = 0; r < info.op->schema().returns().size(); ++r) {
    s.outputs.push_back(replicate_all(info.mesh_ndim()));
  }
  return s;
}

OpSharding single_input(const OpInfo& info, const Placements& want, const Placements& out,
                        size_t num_outputs) {
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = want;
  for (size_t a = 1; a < info.num_args(); ++a) {
    if (info.specs[a]) {
      s.inputs[a] = replicate_all(info.mesh_ndim());
    }
  }
  s.outputs.assign(num_outputs, out);
  return s;
}

std::string describe_args(const OpInfo& info) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < info.num_args(); ++i) {
    if (info.specs[i]) {
      const auto& s = *info.specs[i];
      parts.push_back(
          fmt::format("{}{} {}", c10::toString(s.dtype), s.shape, to_string(s.placements)));
    } else if (!info.list_specs[i].empty()) {
      std::vector<std::string> items;
      for (const auto& s : info.list_specs[i]) {
        items.push_back(
            fmt::format("{}{} {}", c10::toString(s.dtype), s.shape, to_string(s.placements)));
      }
      parts.push_back(fmt::format("[{}]", fmt::join(items, ", ")));
    } else {
      std::ostringstream os;
      os << info.arg(i);
      parts.push_back(os.str());
    }
  }
  return fmt::format("({})", fmt::join(parts, ", "));
}

void fail_unsupported(const OpInfo& info, const std::string& why) {
  DTENSOR_FAIL("{} on DTensors {} over {}: {}", info.name, describe_args(info),
               info.mesh ? info.mesh->to_string() : "?", why);
}

} // namespace dtensor::detail
