// [Note: the decomposition fallback] (decompose.h).
#include "tensor/dispatch/decompose.h"

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "internal/check.h"

namespace dtensor::detail {

namespace {

c10::DispatchKey backend_key(c10::DeviceType device) {
  return device == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
}

// [Note: _foreach_ ops, element by element] aten::_foreach_X.O(lists...) is X on each index
// of its lists: _foreach_add.List -> add.Tensor, .Scalar -> add.Scalar, .ScalarList -> add.Scalar
// with the i-th scalar, .Tensor -> add.Tensor (in-place: _foreach_add_ -> add_). Each element
// is a DTensor with its own placements (parameters sharded differently), so each call meets
// X's rule on its own; PyTorch's DTensor runs its foreach ops per element too.
constexpr const char* kForeach = "aten::_foreach_";

bool is_list_of_scalars(const c10::TypePtr& t) {
  auto list = t->cast<c10::ListType>();
  return list != nullptr && (list->getElementType()->kind() == c10::TypeKind::NumberType ||
                             list->getElementType()->kind() == c10::TypeKind::FloatType);
}

bool is_tensor_list(const c10::TypePtr& t) {
  auto list = t->cast<c10::ListType>();
  return list != nullptr && list->getElementType()->kind() == c10::TypeKind::TensorType;
}

// The per-element op of a foreach op, or none.
std::optional<c10::OperatorHandle> element_op(const c10::FunctionSchema& foreach) {
  const std::string base = "aten::" + foreach.name().substr(std::string(kForeach).size());
  const std::string& ov = foreach.overload_name();
  std::vector<std::string> candidates;
  if (ov == "List" || ov == "Tensor") {
    candidates = {"Tensor", ""};
  } else if (ov == "Scalar" || ov == "ScalarList") {
    candidates = {"Scalar", ""};
  } else {
    candidates = {ov, ""};
  }
  for (const auto& c : candidates) {
    auto h = c10::Dispatcher::singleton().findSchema({base, c});
    if (!h) {
      continue;
    }
    const auto& want = h->schema().arguments();
    const auto& have = foreach.arguments();
    bool ok = want.size() >= have.size();
    for (size_t a = 0; ok && a < want.size(); ++a) {
      if (a >= have.size()) {
        ok = want[a].default_value().has_value();
        continue;
      }
      const c10::TypePtr& w = want[a].type();
      if (is_tensor_list(have[a].type())) {
        ok = w->kind() == c10::TypeKind::TensorType;
      } else if (is_list_of_scalars(have[a].type())) {
        ok = w->kind() == c10::TypeKind::NumberType || w->kind() == c10::TypeKind::FloatType;
      }
    }
    if (ok) {
      return h;
    }
  }
  return std::nullopt;
}

void run_foreach(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto element = element_op(schema);
  DTENSOR_CHECK(element.has_value(), "{}: no per-element op matches it", schema.name());
  const size_t nargs = schema.arguments().size();
  torch::jit::Stack args(stack->end() - static_cast<std::ptrdiff_t>(nargs), stack->end());
  stack->erase(stack->end() - static_cast<std::ptrdiff_t>(nargs), stack->end());
  size_t n = 0;
  for (const auto& v : args) {
    if (v.isTensorList()) {
      n = v.toTensorVector().size();
      break;
    }
  }
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < n; ++i) {
    torch::jit::Stack s;
    for (size_t a = 0; a < nargs; ++a) {
      const c10::IValue& v = args[a];
      if (v.isTensorList()) {
        s.emplace_back(v.toTensorVector().at(i));
      } else if (is_list_of_scalars(schema.arguments()[a].type())) {
        s.push_back(v.toListRef().at(i));
      } else {
        s.push_back(v);
      }
    }
    for (size_t a = nargs; a < element->schema().arguments().size(); ++a) {
      s.push_back(*element->schema().arguments()[a].default_value());
    }
    element->callBoxed(s);
    if (!schema.returns().empty() && !s.empty() && s.back().isTensor()) {
      outs.push_back(s.back().toTensor());
    }
  }
  if (!schema.returns().empty()) {
    stack->emplace_back(c10::List<at::Tensor>(outs));
  }
}

} // namespace

bool has_decomposition(const c10::OperatorHandle& op, c10::DeviceType device) {
  if (op.schema().name().rfind(kForeach, 0) == 0) {
    return element_op(op.schema()).has_value();
  }
  // Views and writes decompose into as_strided and metadata updates of their argument
  // (squeeze_ -> as_strided_), which a DTensor's global strides do not describe.
  const auto& schema = op.schema();
  for (const auto& a : schema.arguments()) {
    if (a.alias_info() != nullptr) {
      return false;
    }
  }
  for (const auto& r : schema.returns()) {
    if (r.alias_info() != nullptr) {
      return false;
    }
  }
  const bool composite =
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
  return composite && !op.hasKernelForDispatchKey(backend_key(device));
}

void run_decomposition(const c10::OperatorHandle& op, c10::DeviceType device,
                       torch::jit::Stack* stack) {
  try {
    if (op.schema().name().rfind(kForeach, 0) == 0) {
      run_foreach(op, stack);
      return;
    }
    // The backend's table entry is the composite kernel (has_decomposition); the ops it
    // calls dispatch on their arguments again, DTensors included.
    op.redispatchBoxed(c10::DispatchKeySet(backend_key(device)), stack);
  } catch (const std::exception& e) {
    DTENSOR_FAIL("{} has no sharding rule and its decomposition failed: {}", op.schema().name(),
                 e.what());
  }
}

} // namespace dtensor::detail
