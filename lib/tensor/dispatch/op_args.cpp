// Helpers for walking and rewriting an op's boxed arguments (lib/tensor/dispatch/op_args.h).
#include "tensor/dispatch/op_args.h"

#include <unordered_map>

#include "mesh/comm_debug.h"
#include "tensor/dtensor_impl.h"
#include "tensor/placement_helpers.h"

namespace dtensor::detail {

OpArgs::OpArgs(const c10::OperatorHandle& op, torch::jit::Stack* s)
    : schema(op.schema()), stack(s), count(op.schema().arguments().size()),
      base(s->size() - op.schema().arguments().size()) {}

// Out of line: inlined, GCC 12 reports a false stringop-overflow in IValue's refcounting.
[[gnu::noinline]] void OpArgs::set(size_t arg, int64_t element, const at::Tensor& value) const {
  c10::IValue& v = (*this)[arg];
  if (element < 0) {
    v = value;
    return;
  }
  if (!v.isTensorList()) { // Tensor?[]
    c10::List<std::optional<at::Tensor>> values;
    for (const c10::IValue& x : v.toListRef()) {
      values.push_back(x.isTensor() ? std::optional<at::Tensor>(x.toTensor()) : std::nullopt);
    }
    values.set(static_cast<size_t>(element), value);
    v = values;
    return;
  }
  std::vector<at::Tensor> values = v.toTensorVector();
  values[static_cast<size_t>(element)] = value;
  v = c10::List<at::Tensor>(values);
}

void assign_ivalue(c10::IValue& slot, c10::IValue value) {
  slot = std::move(value);
}

bool OpArgs::writes(size_t arg) const {
  const auto* alias = schema.arguments()[arg].alias_info();
  return alias != nullptr && alias->isWrite();
}

int64_t aliased_argument(const c10::FunctionSchema& schema, size_t ret) {
  const auto* alias = schema.returns()[ret].alias_info();
  if (alias == nullptr || alias->isWrite()) {
    return -1;
  }
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    const auto* ai = schema.arguments()[a].alias_info();
    if (ai != nullptr && ai->beforeSets() == alias->beforeSets()) {
      return static_cast<int64_t>(a);
    }
  }
  return -1;
}

at::Tensor as_replicate(const at::Tensor& plain, const DeviceMesh& mesh) {
  return make_dtensor(plain, make_spec(mesh, replicate_all(mesh.ndim()), plain.sizes().vec(),
                                       plain.scalar_type(), plain.strides().vec()));
}

bool in_backward() {
  return in_autograd_backward(); // the mesh layer's, which CommDebugMode needs below this one
}

namespace {
thread_local bool recomputing = false;
thread_local bool checkpoint_forward = false;
} // namespace

bool in_recompute() { return recomputing; }

RecomputeGuard::RecomputeGuard() : previous_(recomputing) { recomputing = true; }
RecomputeGuard::~RecomputeGuard() { recomputing = previous_; }

bool in_checkpoint_forward() { return checkpoint_forward; }

CheckpointForwardGuard::CheckpointForwardGuard() : previous_(checkpoint_forward) {
  checkpoint_forward = true;
}
CheckpointForwardGuard::~CheckpointForwardGuard() { checkpoint_forward = previous_; }

// [Note: per-op statics] What never changes for an operator once the library is loaded
// (its full name here; how its rule reads Scalars in lib/tensor/dispatch/dispatch.cpp) is
// computed on its first use on each thread and kept, keyed by the operator's schema (one per
// operator for the process's life): the dispatch path then costs a pointer lookup instead of
// building a string per op. Thread-local, so no lock; a few hundred entries at most.
const std::string& op_full_name(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, std::string> names;
  auto [it, inserted] = names.try_emplace(&op.schema());
  if (inserted) {
    const auto& n = op.operator_name();
    it->second = n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
  }
  return it->second;
}

} // namespace dtensor::detail
