// The DTensor dispatch handler: one boxed kernel for every aten op reaching PrivateUse1.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <c10/util/ScopeExit.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <cstring>
#include <unordered_map>

#include "internal/check.h"
#include "mesh/comm_debug.h"
#include "tensor/dispatch/decompose.h"
#include "tensor/dispatch/handler.h"
#include "tensor/dispatch/interceptors.h"
#include "tensor/dispatch/op_args.h"
#include "tensor/dtensor_impl.h"
#include "tensor/ops/sharding.h"
#include "tensor/redistribute/redistribute.h"
#include "tensor/debug/torch_repr.h"

namespace dtensor::detail {

namespace {

struct Cached {
  OpSharding sharding;
  // No meta kernel and no shapes from the rule, but no output is sharded: every output's
  // global shape is its local shape.
  bool shapes_from_local = false;
  // Per returned tensor (a list return counts once): the global shapes of the outputs.
  std::vector<std::vector<std::vector<int64_t>>> out_shapes;
  // The same for their global strides, when the meta run gave them (empty otherwise: the
  // strides then follow the local result's layout: [Note: global strides]).
  std::vector<std::vector<std::vector<int64_t>>> out_strides;
  // No rule: the op runs its composite kernel ([Note: the decomposition fallback]).
  bool decompose = false;
  // Per argument: the redistribution plan to the placements the rule wants (empty: none),
  // a function of the decision's key, so kept with it: a hit looks up nothing else.
  std::vector<std::vector<TransformStep>> input_plans;
};

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

at::Tensor meta_of(const DTensorSpec& s) {
  return at::empty_strided(s.shape, s.stride, at::TensorOptions().dtype(s.dtype).device(at::kMeta));
}

thread_local bool inferring_shapes = false;

// Runs the op on meta tensors with global shapes to learn the outputs' global shapes.
void infer_output_shapes(const c10::OperatorHandle& op, const OpInfo& info, Cached& out) {
  const bool outer = inferring_shapes;
  inferring_shapes = true;
  const auto restore = c10::make_scope_exit([outer] { inferring_shapes = outer; });
  torch::jit::Stack meta;
  for (size_t i = 0; i < info.num_args(); ++i) {
    const c10::IValue& v = info.arg(i);
    if (info.specs[i]) {
      meta.emplace_back(meta_of(*info.specs[i]));
    } else if (!info.list_specs[i].empty() && v.isTensorList()) {
      c10::List<at::Tensor> l;
      for (const auto& s : info.list_specs[i]) {
        l.push_back(meta_of(s));
      }
      meta.emplace_back(l);
    } else if (!info.list_specs[i].empty()) { // Tensor?[], DTensors in order
      c10::List<std::optional<at::Tensor>> l;
      size_t k = 0;
      for (const c10::IValue& x : v.toListRef()) {
        l.push_back(x.isTensor() ? std::optional<at::Tensor>(meta_of(info.list_specs[i][k++]))
                                 : std::nullopt);
      }
      meta.emplace_back(l);
    } else if (v.isTensor() && v.toTensor().defined()) {
      meta.emplace_back(v.toTensor().to(at::kMeta));
    } else if (v.isDevice()) {
      meta.emplace_back(c10::Device(at::kMeta)); // _to_copy(..., device=cpu) and factories
    } else {
      meta.push_back(v);
    }
  }
  try {
    op.callBoxed(meta);
  } catch (const c10::Error& e) {
    for (const auto& placements : out.sharding.outputs) {
      for (const auto& p : placements) {
        if (p.is_shard() && p.dim() >= out.sharding.leading_dims_from_input) {
          fail_unsupported(info,
                           fmt::format("its output shape could not be inferred on meta tensors "
                                       "and its rule gives none ({})",
                                       e.what_without_backtrace()));
        }
      }
    }
    out.shapes_from_local = true;
    return;
  }
  for (const auto& r : meta) {
    std::vector<std::vector<int64_t>> shapes;
    std::vector<std::vector<int64_t>> strides;
    if (r.isTensor()) {
      const at::Tensor& t = r.toTensor();
      shapes.push_back(t.defined() ? t.sizes().vec() : std::vector<int64_t>{});
      strides.push_back(t.defined() ? t.strides().vec() : std::vector<int64_t>{});
    } else if (r.isTensorList()) {
      for (const at::Tensor& t : r.toTensorVector()) {
        shapes.push_back(t.sizes().vec());
        strides.push_back(t.strides().vec());
      }
    }
    out.out_shapes.push_back(std::move(shapes));
    out.out_strides.push_back(std::move(strides));
  }
}

// [Note: global strides]
// A DTensor's sizes and strides are the global tensor's, as the plain op would give them:
// `d.transpose(1, 2).is_contiguous()` must be false so that `contiguous()` copies and the
// attention reshape `.contiguous().view(...)` works. The meta run gives the exact strides
// (views included). Rules that give output shapes skip the meta run (some kernels have no
// Meta kernel in C++); their outputs are new tensors, dense in the order of the local
// result's strides, which is what the plain op gives (TensorIterator keeps the inputs'
// dimension order).
std::vector<int64_t> dense_strides_like(const at::Tensor& local,
                                        const std::vector<int64_t>& shape) {
  const auto ndim = static_cast<int64_t>(shape.size());
  if (local.dim() != ndim || local.is_contiguous()) {
    return contiguous_strides(shape);
  }
  std::vector<int64_t> order(static_cast<size_t>(ndim));
  for (int64_t d = 0; d < ndim; ++d) {
    order[static_cast<size_t>(d)] = d;
  }
  // Outermost first: larger local stride first; ties keep the logical order.
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return local.stride(a) > local.stride(b); });
  std::vector<int64_t> stride(static_cast<size_t>(ndim), 1);
  int64_t running = 1;
  for (size_t k = order.size(); k-- > 0;) {
    auto d = static_cast<size_t>(order[k]);
    stride[d] = running;
    running *= std::max<int64_t>(shape[d], 1);
  }
  return stride;
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

// Unwrap, step 1: the specs of the DTensor arguments, which must share one mesh; plain
// tensors mix in only as scalars (0-dim).
void collect_specs(OpInfo& info, const OpArgs& a) {
  info.specs.resize(a.count);
  info.list_specs.resize(a.count);
  info.mesh = nullptr;
  std::vector<std::string> plain_args;
  a.for_each_tensor([&](size_t i, int64_t element, const at::Tensor& t) {
    const DTensorMeta* m = dtensor_meta(t);
    if (m == nullptr) {
      if (element >= 0) {
        plain_args.push_back(fmt::format("an element of argument {} '{}'", i, a.name_of(i)));
      } else if (t.defined() && t.dim() > 0) {
        plain_args.push_back(fmt::format("argument {} '{}' ({}{})", i, a.name_of(i),
                                         c10::toString(t.scalar_type()), t.sizes()));
      }
      return;
    }
    if (element < 0) {
      info.specs[i] = SpecRef(&m->spec); // alive with the handler's copy of the arguments
    } else {
      info.list_specs[i].push_back(m->spec);
    }
    if (info.mesh == nullptr) {
      info.mesh = &m->spec.mesh;
    } else {
      DTENSOR_CHECK(*info.mesh == m->spec.mesh,
                    "{}: DTensor arguments live on different meshes: {} and {}", info.name,
                    info.mesh->to_string(), m->spec.mesh.to_string());
    }
  });
  DTENSOR_CHECK(info.mesh != nullptr, "{}: reached the DTensor handler without DTensor arguments",
                info.name);
  DTENSOR_CHECK(plain_args.empty(),
                "{}: mixes DTensors with plain tensors ({}); only scalars and 0-dim tensors mix "
                "implicitly: convert the others with distribute_tensor or DTensor::from_local",
                info.name, fmt::join(plain_args, ", "));
}

// [Note: shape arguments] (lib/tensor/ops/sharding.h): the size (and stride) argument of a
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
// rule asks; arguments the rule rewrites for the local op get their local values.
void unwrap_args(const OpInfo& info, const Cached& decision, const OpArgs& a) {
  const OpSharding& sharding = decision.sharding;
  for (size_t i = 0; i < a.count; ++i) {
    c10::IValue& slot = a[i];
    if (info.specs[i]) {
      const DTensorMeta* m = dtensor_meta(info.arg(i).toTensor());
      at::Tensor local = m->local;
      if (sharding.inputs[i] && *sharding.inputs[i] != m->spec.placements) {
        DTENSOR_CHECK(!a.writes(i),
                      "{}: argument '{}' is written in place but would have to be redistributed "
                      "from {} to {}; redistribute it explicitly first",
                      info.name, a.name_of(i), to_string(m->spec.placements),
                      to_string(*sharding.inputs[i]));
        local = execute_redistribute(local, m->spec, decision.input_plans[i]);
      }
      slot = local;
    } else if (!info.list_specs[i].empty()) {
      auto local_of = [&](const at::Tensor& t) {
        const DTensorMeta* m = dtensor_meta(t);
        at::Tensor local = m->local;
        if (sharding.list_inputs[i] && *sharding.list_inputs[i] != m->spec.placements) {
          local = redistribute_local(local, m->spec, *sharding.list_inputs[i]);
        }
        return local;
      };
      if (info.arg(i).isTensorList()) {
        c10::List<at::Tensor> locals;
        for (const at::Tensor& t : info.arg(i).toTensorVector()) {
          locals.push_back(local_of(t));
        }
        slot = locals;
      } else { // Tensor?[]
        c10::List<std::optional<at::Tensor>> locals;
        for (const c10::IValue& x : info.arg(i).toListRef()) {
          locals.push_back(x.isTensor() ? std::optional<at::Tensor>(local_of(x.toTensor()))
                                        : std::nullopt);
        }
        slot = locals;
      }
    }
    if (sharding.local_args[i]) {
      slot = *sharding.local_args[i];
    }
  }
}

void run_local(const c10::OperatorHandle& op, const OpInfo& info, torch::jit::Stack* stack) {
  try {
    op.callBoxed(*stack);
  } catch (const c10::Error& e) {
    // The local kernel refused its arguments: say so in dtensor's terms.
    DTENSOR_FAIL("{}: the local op failed on rank {} for arguments {}: {}", info.name, get_rank(),
                 describe_args(info), e.what_without_backtrace());
  }
}

// The spec of output `r` (element `element` of a list output) over local result `local`.
DTensorSpec output_spec(const OpInfo& info, const Cached& decision, size_t r, size_t element,
                        const at::Tensor& local) {
  DTENSOR_CHECK(r < decision.sharding.outputs.size(),
                "{}: its sharding rule gave no placements for output {}", info.name, r);
  DTensorSpec s;
  s.mesh = *info.mesh;
  s.placements = decision.sharding.outputs[r];
  if (decision.shapes_from_local) {
    s.shape = local.sizes().vec();
    s.stride = local.strides().vec();
    const auto lead = std::min<int64_t>(decision.sharding.leading_dims_from_input,
                                        static_cast<int64_t>(s.shape.size()));
    bool resized = false;
    for (const auto& p : s.placements) {
      if (p.is_shard() && p.dim() < lead) {
        s.shape[p.dim()] = info.specs[0]->shape[p.dim()];
        resized = true;
      }
    }
    if (resized) {
      s.stride = dense_strides_like(local, s.shape);
    }
  } else {
    s.shape = decision.out_shapes[r][element];
    s.stride = r < decision.out_strides.size() && element < decision.out_strides[r].size()
                   ? decision.out_strides[r][element]
                   : dense_strides_like(local, s.shape);
  }
  s.dtype = local.scalar_type();
  return s;
}

// Wrap: local results become DTensors (in-place and out= returns are their DTensor
// arguments again), each finished by the interceptors that asked to.
void wrap_outputs(const c10::OperatorHandle& op, const OpInfo& info, const Cached& decision,
                  torch::jit::Stack* stack, const std::vector<OutputFinisher>& finishers) {
  const auto& schema = op.schema();
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  auto wrap = [&](size_t r, size_t element, const at::Tensor& local) {
    DTensorSpec spec = output_spec(info, decision, r, element, local);
    // [Note: empty shards] Some kernels return an input with no elements as it is
    // (pixel_unshuffle on an empty batch shard): no values are lost by giving it the shape
    // the output's spec says this rank holds, also empty.
    at::Tensor piece = local;
    if (local.numel() == 0) {
      const std::vector<int64_t> want = spec.local_shape();
      if (want != local.sizes().vec() && c10::multiply_integers(want) == 0) {
        piece = at::empty(want, local.options());
      }
    }
    at::Tensor out = make_dtensor(piece, std::move(spec));
    for (const auto& finish : finishers) {
      finish(out);
    }
    return out;
  };
  for (size_t r = 0; r < nret; ++r) {
    c10::IValue& slot = (*stack)[rbase + r];
    const auto* alias = schema.returns()[r].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      for (size_t a = 0; a < info.num_args(); ++a) {
        const auto* ai = schema.arguments()[a].alias_info();
        if (ai != nullptr && ai->beforeSets() == alias->beforeSets()) {
          slot = info.arg(a);
          break;
        }
      }
    } else if (slot.isTensor() && slot.toTensor().defined()) {
      slot = wrap(r, 0, slot.toTensor());
    } else if (slot.isTensorList()) {
      c10::List<at::Tensor> wrapped;
      size_t e = 0;
      for (const at::Tensor& t : slot.toTensorVector()) {
        wrapped.push_back(wrap(r, e++, t));
      }
      slot = wrapped;
    }
  }
}

// [Note: module attribution] CommDebugMode lists DTensor operations per module as PyTorch's
// does: "aten.mm.default", and for each DTensor argument its global shape and placements (as
// the rule sees them: after tensor parallelism's input conversions), and the mesh.
void record_for_comm_debug(const c10::OperatorHandle& op, const OpInfo& info) {
  OpRecord rec;
  const auto& name = op.schema().operator_name();
  std::string qualified = name.name; // "aten::mm" -> "aten.mm"
  if (auto sep = qualified.find("::"); sep != std::string::npos) {
    qualified.replace(sep, 2, ".");
  }
  rec.name = fmt::format("{}.{}", qualified,
                         name.overload_name.empty() ? "default" : name.overload_name);
  for (const auto& spec : info.specs) {
    if (spec.has_value()) {
      rec.input_shape.push_back(torch_size_repr(spec->shape));
      rec.input_sharding.push_back(torch_repr(spec->placements));
    }
  }
  rec.device_mesh = torch_repr(*info.mesh);
  record_dtensor_op(std::move(rec));
}

ArgSummary summarize(const OpArgs& a) {
  ArgSummary s;
  a.for_each_tensor([&](size_t, int64_t element, const at::Tensor& t) {
    if (const DTensorMeta* m = dtensor_meta(t)) {
      s.any_dtensor = true;
      s.any_extension = s.any_extension || m->has_extensions();
    } else if (t.defined() && (t.dim() > 0 || element >= 0)) {
      s.any_plain = true;
    }
  });
  return s;
}

} // namespace

bool in_shape_inference() {
  return inferring_shapes;
}

// [Note: the handler's steps] As PyTorch's OpDispatcher: one walk of the arguments
// (summarize), the interceptors that the op can concern, then unwrap (specs) -> decide (rule
// and redistribution plans, one cache) -> redistribute the arguments -> run the local op ->
// wrap. An op no subsystem claims (no extension on its DTensors, no plain tensor among them)
// asks no interceptor but loss parallelism's flag.
void handler(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  std::vector<OutputFinisher> finishers;
  const OpArgs a(op, stack);
  const ArgSummary summary = summarize(a);
  bool rewritten = false;
  for (const OpInterceptor& i : interceptors()) {
    if (i.wants != nullptr && !i.wants(summary)) {
      continue;
    }
    if (i.run != nullptr && i.run(op, stack)) {
      return;
    }
    if (i.prepare != nullptr) {
      rewritten = true; // it may have rewritten the arguments
      if (OutputFinisher f = i.prepare(op, stack)) {
        finishers.push_back(std::move(f));
      }
    }
  }
  if (!(rewritten ? summarize(a).any_dtensor : summary.any_dtensor)) {
    op.callBoxed(*stack); // an interceptor made every argument plain ([Note: local outputs])
    return;
  }
  // The arguments as they came (the stack's slots are rewritten with local tensors below;
  // this copy keeps the DTensors, whose specs info.specs points into, alive).
  torch::jit::Stack args(stack->begin() + static_cast<std::ptrdiff_t>(a.base), stack->end());
  OpInfo info;
  info.op = &op;
  info.name = op_full_name(op);
  info.args = &args;
  collect_specs(info, a);
  if (comm_debug_active()) {
    record_for_comm_debug(op, info);
  }
  const std::shared_ptr<const Cached> decision = decide(op, info);
  if (decision->decompose) {
    run_decomposition(op, info.mesh->device_type(), stack);
    return;
  }
  unwrap_args(info, *decision, a);
  if (decision->sharding.local_kernel != nullptr) {
    decision->sharding.local_kernel(info, decision->sharding, stack);
  } else {
    run_local(op, info, stack);
  }
  wrap_outputs(op, info, *decision, stack, finishers);
}

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
