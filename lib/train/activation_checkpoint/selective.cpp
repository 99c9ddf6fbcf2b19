// Selective activation checkpointing: the op mode behind ActivationCheckpointOptions::policy.
#include "train/activation_checkpoint/selective.h"

#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include "internal/check.h"
#include "mesh/dispatch_keys.h"
#include "tensor/dispatch/op_args.h"
#include "tensor/dtensor_impl.h"

namespace dtensor {

CheckpointPolicyFn save_ops(std::vector<std::string> names) {
  auto wanted = std::make_shared<const std::unordered_set<std::string>>(names.begin(), names.end());
  return [wanted](const c10::OperatorHandle& op) {
    const auto& n = op.operator_name();
    const bool named =
        wanted->count(n.name) > 0 ||
        (!n.overload_name.empty() && wanted->count(n.name + "." + n.overload_name) > 0);
    return named ? CheckpointPolicy::MustSave : CheckpointPolicy::PreferRecompute;
  };
}

namespace detail {

// [Note: selective checkpointing as a dispatch mode]
// PyTorch's selective checkpointing is a TorchDispatchMode: every aten op below autograd
// passes through it. C++ has no modes, so this one is a dispatch key: while a guard lives,
// the thread's included key set holds the PrivateUse2 backend (a backend no tensor here
// has), and with the highest backend bit, every op's backend kernel is looked up at
// PrivateUse2: this file's fallback (and its kernel for the ops that have a
// CompositeExplicitAutograd kernel, which would otherwise sit at PrivateUse2 too, as
// dtensor's handler does at PrivateUse1). Autograd runs first as usual (AutogradPrivateUse2
// has autograd's kernels). The fallback runs the op with the thread's key set as it was
// outside the mode (a DTensor then reaches dtensor's handler; the op's own inner ops do
// not meet the mode again) and
//  - recording (forward): keeps the outputs of each op the policy saves;
//  - replaying (the recompute): gives those outputs back instead of running the op, in
//    order, checking that it is the same op.
// The policy is not asked about views and in-place ops (their outputs alias inputs the
// recompute makes anew) nor random ops (skipping one would shift the random stream of
// every later one): they always run. A saved output written in place later in forward
// (LibTorch's linear adds its bias in place to its matmul's output, through an
// _unsafe_view that shares the storage) is copied just before the write: the recompute
// then gets the value the op gave, and writes it again itself. (PyTorch raises there.)
struct SelectiveMode {
  CheckpointPolicyFn policy;
  SavedOps* saved = nullptr;
  bool replay = false;
  c10::impl::LocalDispatchKeySet outside{c10::impl::tls_local_dispatch_key_set()};
  SelectiveMode* previous = nullptr;
  // Recording: the storages of the saved outputs, each with its (entry, output) places.
  std::unordered_map<const c10::StorageImpl*, std::vector<std::pair<size_t, size_t>>>
      saved_storages;
};

namespace {

thread_local SelectiveMode* active = nullptr;

// Views, in-place and out= ops, and random ops: always run, never asked about.
bool always_runs(const c10::OperatorHandle& op) {
  const c10::FunctionSchema& schema = op.schema();
  if (op.hasTag(at::Tag::nondeterministic_seeded)) {
    return true;
  }
  for (const auto& r : schema.returns()) {
    if (r.alias_info() != nullptr) {
      return true;
    }
  }
  for (const auto& a : schema.arguments()) {
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) {
      return true;
    }
  }
  return false;
}

bool saves(const SelectiveMode& m, const c10::OperatorHandle& op) {
  if (always_runs(op)) {
    return false;
  }
  const CheckpointPolicy p = m.policy(op);
  return p == CheckpointPolicy::MustSave || p == CheckpointPolicy::PreferSave;
}

// The storage a tensor's values live in (a DTensor's: its local tensor's), or nullptr.
const c10::StorageImpl* storage_of(const at::Tensor& t) {
  if (!t.defined()) {
    return nullptr;
  }
  if (const DTensorMeta* m = dtensor_meta(t)) {
    return storage_of(m->local);
  }
  return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

// Before an op writes in place: saved outputs sharing a written storage are copied first.
void copy_saved_before_write(SelectiveMode& m, const c10::OperatorHandle& op,
                             const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const size_t base = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[base + i];
    if (args[i].alias_info() == nullptr || !args[i].alias_info()->isWrite() || !v.isTensor()) {
      continue;
    }
    auto it = m.saved_storages.find(storage_of(v.toTensor()));
    if (it == m.saved_storages.end()) {
      continue;
    }
    for (const auto& [entry, output] : it->second) {
      c10::IValue& saved = m.saved->entries[entry].outputs[output];
      c10::impl::ForceDispatchKeyGuard outside(m.outside);
      saved = saved.toTensor().clone(at::MemoryFormat::Preserve);
    }
    m.saved_storages.erase(it);
  }
}

void remember_saved(SelectiveMode& m, size_t entry) {
  const auto& outputs = m.saved->entries[entry].outputs;
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (outputs[j].isTensor()) {
      if (const c10::StorageImpl* s = storage_of(outputs[j].toTensor())) {
        m.saved_storages[s].emplace_back(entry, j);
      }
    }
  }
}

// The op's next kernel below the mode, with the mode off for what it calls in turn: the
// thread's keys as they are here (autograd's guards included) less the mode's.
void run_below(const SelectiveMode& m, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
               torch::jit::Stack* stack) {
  c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();
  keys.included_ = keys.included_.remove_backend(kSelectiveCheckpointBackend);
  if (!m.outside.included_.has(c10::DispatchKey::Dense)) {
    keys.included_ = keys.included_ - c10::DispatchKeySet(c10::DispatchKey::Dense);
  }
  c10::impl::ForceDispatchKeyGuard below(keys);
  op.redispatchBoxed(ks.remove_backend(kSelectiveCheckpointBackend), stack);
}

void mode_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  SelectiveMode* m = active;
  if (m == nullptr) { // a PrivateUse2 tensor outside a mode: not ours
    DTENSOR_CHECK(false,
                  "{}: dispatched to PrivateUse2 outside selective checkpointing; "
                  "dtensor's selective checkpointing uses that key for itself",
                  op_full_name(op));
  }
  if (!m->replay) {
    copy_saved_before_write(*m, op, *stack);
    const bool keep = saves(*m, op);
    run_below(*m, op, ks, stack);
    if (keep) {
      const auto n = static_cast<ptrdiff_t>(op.schema().returns().size());
      m->saved->entries.push_back(
          {op.operator_name(), std::vector<c10::IValue>(stack->end() - n, stack->end())});
      remember_saved(*m, m->saved->entries.size() - 1);
    }
    return;
  }
  SavedOps& s = *m->saved;
  if (!saves(*m, op)) {
    run_below(*m, op, ks, stack);
    return;
  }
  DTENSOR_CHECK(
      s.next < s.entries.size() && s.entries[s.next].op == op.operator_name(),
      "activation_checkpoint: the recompute ran {} where forward ran {} (saved op {} of {}); a "
      "checkpointed function must run the same ops each time",
      op_full_name(op),
      s.next < s.entries.size() ? c10::toString(s.entries[s.next].op) : "nothing more", s.next + 1,
      s.entries.size());
  torch::jit::drop(*stack, op.schema().arguments().size());
  for (auto& v : s.entries[s.next].outputs) {
    stack->push_back(std::move(v));
  }
  ++s.next;
}

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    static std::unique_ptr<torch::Library> lib = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", kSelectiveCheckpointKey, __FILE__, __LINE__);
    auto& d = c10::Dispatcher::singleton();
    for (const auto& name : d.getAllOpNames()) {
      auto h = d.findOp(name);
      if (!h || name.name.rfind("aten::", 0) != 0 ||
          h->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
          h->hasKernelForDispatchKey(kSelectiveCheckpointKey) ||
          !(h->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
            h->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))) {
        continue;
      }
      const std::string op =
          name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
      lib->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&mode_kernel>());
    }
  });
}

std::unique_ptr<SelectiveMode> enter(CheckpointPolicyFn policy, SavedOps& saved, bool replay) {
  ensure_registered();
  auto m = std::make_unique<SelectiveMode>();
  m->policy = std::move(policy);
  m->saved = &saved;
  m->replay = replay;
  m->previous = active;
  active = m.get();
  c10::impl::LocalDispatchKeySet inside = m->outside;
  inside.included_ = inside.included_ | c10::DispatchKeySet(kSelectiveCheckpointKey);
  c10::impl::_force_tls_local_dispatch_key_set(inside);
  return m;
}

void leave(const SelectiveMode& m) {
  c10::impl::_force_tls_local_dispatch_key_set(m.outside);
  active = m.previous;
}

} // namespace

SelectiveRecordGuard::SelectiveRecordGuard(const CheckpointPolicyFn& policy, SavedOps& saved)
    : mode_(enter(policy, saved, /*replay=*/false)) {
  saved.entries.clear();
  saved.next = 0;
}

SelectiveRecordGuard::~SelectiveRecordGuard() {
  leave(*mode_);
}

SelectiveReplayGuard::SelectiveReplayGuard(const CheckpointPolicyFn& policy, SavedOps& saved)
    : mode_(enter(policy, saved, /*replay=*/true)) {
  saved.next = 0;
}

SelectiveReplayGuard::~SelectiveReplayGuard() {
  leave(*mode_);
}

void SelectiveReplayGuard::finish() {
  const SavedOps& s = *mode_->saved;
  DTENSOR_CHECK(
      s.next == s.entries.size(),
      "activation_checkpoint: the recompute used {} of the {} saved op outputs (next: {}); the "
      "function must run the same ops in the recompute as in forward",
      s.next, s.entries.size(),
      s.next < s.entries.size() ? c10::toString(s.entries[s.next].op) : "");
}

} // namespace detail
} // namespace dtensor

namespace {
// The mode's fallback at kSelectiveCheckpointKey ([Note: the dispatch keys dtensor occupies]).
[[maybe_unused]] const bool mode_fallback_registered =
    (dtensor::detail::register_fallback(
         dtensor::detail::kSelectiveCheckpointKey,
         torch::CppFunction::makeFromBoxedFunction<&dtensor::detail::mode_kernel>(),
         "selective activation checkpointing's mode"),
     true);
} // namespace
