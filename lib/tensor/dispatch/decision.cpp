// The handler's decision: keys, the cache, and the decision itself (tensor/dispatch/decision.h).
#include "tensor/dispatch/decision.h"

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "internal/check.h"
#include "tensor/dispatch/decompose.h"
#include "tensor/dispatch/handler.h"
#include "tensor/dispatch/op_args.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

// [Note: decision keys] A decision is cached under a flat list of integers that spells out
// the op (its schema's address), every spec in full (mesh hash, dtype, placements, shape,
// stride), plain tensors' dtypes and sizes, Scalar arguments (their signs only for rules that
// read no more) and every other argument. Tags and lengths make the encoding prefix-free, so
// equal keys mean equal decisions, and lookups compare keys exactly (the hash only picks the
// bucket). The key is built in a thread-local buffer: a cache hit allocates nothing.
using DecisionKey = std::vector<int64_t>;

struct DecisionKeyHash {
  size_t operator()(const DecisionKey& k) const noexcept {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ k.size();
    for (int64_t v : k) {
      h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

struct DecisionCache {
  std::mutex mutex;
  std::unordered_map<DecisionKey, std::shared_ptr<const Cached>, DecisionKeyHash> entries;
};

DecisionCache& decision_cache() {
  static DecisionCache cache;
  return cache;
}
constexpr size_t kMaxCachedDecisions = 8192;

enum KeyTag : int64_t { kSpec = 1, kSpecList, kTensor, kSign, kInt, kDouble, kBool, kNone, kInts, kText };

int64_t bits_of(double x) {
  int64_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

void append_ints(DecisionKey& key, c10::ArrayRef<int64_t> values) {
  key.push_back(static_cast<int64_t>(values.size()));
  key.insert(key.end(), values.begin(), values.end());
}

void append_text(DecisionKey& key, const std::string& text) {
  key.push_back(kText);
  key.push_back(static_cast<int64_t>(text.size()));
  for (char c : text) {
    key.push_back(c);
  }
}

void append_spec(DecisionKey& key, const DTensorSpec& s) {
  key.push_back(static_cast<int64_t>(s.mesh.hash()));
  key.push_back(static_cast<int64_t>(s.dtype));
  key.push_back(static_cast<int64_t>(s.placements.size()));
  for (const auto& p : s.placements) {
    key.push_back(static_cast<int64_t>(p.kind()));
    if (p.is_shard()) {
      key.push_back(p.dim());
    } else if (p.is_partial()) {
      key.push_back(static_cast<int64_t>(p.reduce_op()));
      key.push_back(p.is_norm_partial() ? bits_of(p.norm_p()) : -1);
    }
  }
  append_ints(key, s.shape);
  append_ints(key, s.stride);
}

void append_value(DecisionKey& key, const c10::IValue& v, bool sign_only_number) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    key.push_back(kTensor);
    key.push_back(t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1);
    append_ints(key, t.defined() ? t.sizes() : c10::IntArrayRef());
  } else if (sign_only_number && v.isScalar() && !v.isComplexDouble()) {
    const double x = v.toScalar().toDouble();
    key.push_back(kSign);
    key.push_back(x > 0 ? 1 : x < 0 ? -1 : x == 0 ? 0 : 2);
  } else if (v.isInt()) {
    key.push_back(kInt);
    key.push_back(v.toInt());
  } else if (v.isDouble()) {
    key.push_back(kDouble);
    key.push_back(bits_of(v.toDouble()));
  } else if (v.isBool()) {
    key.push_back(kBool);
    key.push_back(v.toBool() ? 1 : 0);
  } else if (v.isNone()) {
    key.push_back(kNone);
  } else if (v.isIntList()) {
    const c10::List<int64_t> list = v.toIntList(); // shares the list: no copy
    key.push_back(kInts);
    key.push_back(static_cast<int64_t>(list.size()));
    for (int64_t x : list) {
      key.push_back(x);
    }
  } else {
    append_text(key, c10::str(v)); // rare kinds (strings, devices, lists of others): spelled out
  }
}

// Whether the op's rule reads Scalars by sign only, per operator ([Note: per-op statics] in
// lib/tensor/dispatch/op_args.cpp: rules are registered once, at load).
bool reads_scalar_sign_only(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, bool> sign_only;
  auto [it, inserted] = sign_only.try_emplace(&op.schema(), false);
  if (inserted) {
    it->second = rule_reads_scalar_sign_only(op_full_name(op), op.schema().name());
  }
  return it->second;
}

// Fills `key` (cleared first) for `info`.
void fill_key(DecisionKey& key, const OpInfo& info) {
  key.clear();
  key.push_back(reinterpret_cast<intptr_t>(&info.op->schema()));
  const bool sign_only = reads_scalar_sign_only(*info.op);
  const auto& schema_args = info.op->schema().arguments();
  for (size_t i = 0; i < info.num_args(); ++i) {
    if (info.specs[i]) {
      key.push_back(kSpec);
      append_spec(key, *info.specs[i]);
    } else if (!info.list_specs[i].empty()) {
      key.push_back(kSpecList);
      key.push_back(static_cast<int64_t>(info.list_specs[i].size()));
      for (const auto& s : info.list_specs[i]) {
        append_spec(key, s);
      }
      if (!info.arg(i).isTensorList()) { // Tensor?[]: where the Nones are
        for (const c10::IValue& x : info.arg(i).toListRef()) {
          key.push_back(x.isNone() ? 0 : 1);
        }
      }
    } else {
      append_value(key, info.arg(i), sign_only && schema_args[i].type()->kind() == c10::TypeKind::NumberType);
    }
  }
}

bool all_replicated(const OpInfo& info) {
  auto replicated = [](const DTensorSpec& spec) {
    for (const auto& p : spec.placements) {
      if (!p.is_replicate()) {
        return false;
      }
    }
    return true;
  };
  for (size_t i = 0; i < info.num_args(); ++i) {
    if (info.specs[i] && !replicated(*info.specs[i])) {
      return false;
    }
    for (const auto& s : info.list_specs[i]) {
      if (!replicated(s)) {
        return false;
      }
    }
  }
  return true;
}

bool returns_tensors(const c10::FunctionSchema& schema) {
  for (const auto& r : schema.returns()) {
    const auto& type = r.type();
    if (type->kind() == c10::TypeKind::TensorType || type->kind() == c10::TypeKind::ListType ||
        type->kind() == c10::TypeKind::OptionalType) {
      return true;
    }
  }
  return false;
}

// [Note: shape arguments] (lib/tensor/ops/registry.h): the size (and stride) argument of a
// table op becomes this rank's local shape of its output.
void localize_shape_args(const OpInfo& info, Cached& c) {
  const ShapeArgs* args = shape_args_of(info.op->schema().name());
  if (args == nullptr) {
    return;
  }
  DTENSOR_CHECK(!c.sharding.outputs.empty() && !c.out_shapes.empty() && !c.out_shapes[0].empty(),
                "{}: the global shape of its output is unknown (no meta kernel), so its size "
                "argument cannot be made local",
                info.name);
  const std::vector<int64_t> local =
      local_shape_of(*info.mesh, c.sharding.outputs[0], c.out_shapes[0][0]);
  c.sharding.local_args[static_cast<size_t>(args->shape)] = c10::IValue(local);
  if (args->stride >= 0) {
    c.sharding.local_args[static_cast<size_t>(args->stride)] =
        c10::IValue(contiguous_strides(local));
  }
}

// The redistributions the decision asks of its DTensor arguments, planned once.
void plan_inputs(const OpInfo& info, Cached& c) {
  c.input_plans.resize(info.num_args());
  for (size_t i = 0; i < info.num_args(); ++i) {
    const auto& want = c.sharding.inputs[i];
    if (info.specs[i] && want && *want != info.specs[i]->placements) {
      c.input_plans[i] = plan_redistribute(*info.specs[i], *want);
    }
  }
}

// Decide, uncached: the rule's shardings (or [Note: the replicated fallback]) and the
// outputs' global shapes.
std::shared_ptr<const Cached> make_decision(const c10::OperatorHandle& op, const OpInfo& info) {
  const auto& schema = op.schema();
  ShardingRule rule = find_rule(std::string(info.name), schema.name());
  if (rule == nullptr) {
    // [Note: the replicated fallback]
    // An op without a rule still runs when every DTensor argument is Replicate on every
    // mesh dimension: each rank computes the same result from the same inputs, so the
    // outputs are Replicate, with no communication. Anything else needs a rule.
    if (!all_replicated(info)) {
      if (has_decomposition(op, info.mesh->device_type())) {
        auto made = std::make_shared<Cached>();
        made->decompose = true;
        return made;
      }
      fail_unsupported(info, "no sharding rule is registered for it and it has no "
                             "decomposition (ops without either only run on DTensors that "
                             "are Replicate everywhere)");
    }
    rule = all_replicate;
  }
  auto made = std::make_shared<Cached>();
  made->sharding = rule(info);
  made->sharding.inputs.resize(info.num_args());
  made->sharding.list_inputs.resize(info.num_args());
  made->sharding.local_args.resize(info.num_args());
  if (!made->sharding.output_shapes.empty()) {
    for (const auto& shape : made->sharding.output_shapes) {
      made->out_shapes.push_back({shape});
    }
  } else if (returns_tensors(schema)) {
    infer_output_shapes(op, info, *made);
  }
  localize_shape_args(info, *made);
  plan_inputs(info, *made);
  return made;
}

// Decide: cached by op, input specs and the other arguments ([Note: decision keys]).
} // namespace

std::shared_ptr<const Cached> decide(const c10::OperatorHandle& op, const OpInfo& info) {
  thread_local DecisionKey key;
  fill_key(key, info);
  DecisionCache& cache = decision_cache();
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    auto it = cache.entries.find(key);
    if (it != cache.entries.end()) {
      return it->second;
    }
  }
  std::shared_ptr<const Cached> decision = make_decision(op, info);
  std::lock_guard<std::mutex> lock(cache.mutex);
  if (cache.entries.size() >= kMaxCachedDecisions) {
    cache.entries.clear();
  }
  cache.entries.emplace(key, decision);
  return decision;
}

// Unwrap, step 2: every DTensor argument becomes its local tensor, redistributed where the

size_t decision_cache_size() {
  DecisionCache& cache = decision_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return cache.entries.size();
}

void clear_decision_cache() {
  DecisionCache& cache = decision_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.entries.clear();
}

size_t decision_cache_bound() {
  return kMaxCachedDecisions;
}

} // namespace dtensor::detail
