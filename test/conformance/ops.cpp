// Scenario "ops" (sc_ops.py): each case calls one aten op through the dispatcher on
// DTensors made with from_local, from the argument list the Python side wrote.
#include <cstdio>
#include <cstdlib>

#include <ATen/core/dispatch/Dispatcher.h>

#include "oracle.h"

namespace conformance {
namespace {

using dtensor::DTensor;

// An unpickled value (generic lists) in the type the schema argument wants.
c10::IValue typed(const c10::IValue& v, const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (auto opt = t->cast<c10::OptionalType>()) {
    if (v.isNone()) {
      return v;
    }
    t = opt->getElementType();
  }
  auto list = t->cast<c10::ListType>();
  if (list == nullptr || !v.isList()) {
    return v;
  }
  const c10::TypePtr& elem = list->getElementType();
  if (elem->kind() == c10::TypeKind::IntType || elem->kind() == c10::TypeKind::SymIntType) {
    c10::List<int64_t> out;
    for (const auto& e : v.toListRef()) {
      out.push_back(e.toInt());
    }
    return out;
  }
  if (elem->kind() == c10::TypeKind::FloatType) {
    c10::List<double> out;
    for (const auto& e : v.toListRef()) {
      out.push_back(e.toDouble());
    }
    return out;
  }
  if (elem->kind() == c10::TypeKind::BoolType) {
    c10::List<bool> out;
    for (const auto& e : v.toListRef()) {
      out.push_back(e.toBool());
    }
    return out;
  }
  return v;
}

std::vector<at::Tensor> make_inputs(Ctx& ctx, const Case& c, const dtensor::DeviceMesh& mesh) {
  std::vector<at::Tensor> out;
  const c10::IValue inputs = c["inputs"];
  for (const c10::IValue& in : inputs.toListRef()) {
    Case i(in);
    out.push_back(DTensor::from_local(i.tensor_at("locals", ctx.rank).clone(), mesh,
                                      placements(i.strings("names")), i.ints("shape")));
  }
  return out;
}

torch::jit::Stack make_stack(const c10::FunctionSchema& schema, const Case& c,
                             const std::vector<at::Tensor>& tensors) {
  torch::jit::Stack stack;
  const c10::IValue args = c["args"];
  const auto& given = args.toListRef();
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    const auto& arg = schema.arguments()[a];
    if (a >= given.size()) {
      TORCH_CHECK(arg.default_value().has_value(), "argument ", arg.name(), " has no default");
      stack.push_back(*arg.default_value());
      continue;
    }
    const c10::IValue& v = given[a];
    if (v.isGenericDict() && v.toGenericDict().contains("t")) {
      stack.push_back(tensors.at(static_cast<size_t>(v.toGenericDict().at("t").toInt())));
    } else if (v.isGenericDict() && v.toGenericDict().contains("tl")) {
      c10::List<at::Tensor> list;
      const c10::IValue idx = v.toGenericDict().at("tl");
      for (const auto& i : idx.toListRef()) {
        list.push_back(tensors.at(static_cast<size_t>(i.toInt())));
      }
      stack.push_back(list);
    } else {
      stack.push_back(typed(v, arg.type()));
    }
  }
  return stack;
}

std::vector<at::Tensor> outputs(const torch::jit::Stack& stack) {
  std::vector<at::Tensor> out;
  for (const c10::IValue& v : stack) {
    if (v.isTensor()) {
      out.push_back(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) {
        out.push_back(t);
      }
    }
  }
  return out;
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string key = c.str("key");
    if (std::getenv("CONFORMANCE_TRACE") != nullptr) {
      std::fprintf(stderr, "[rank %ld] %s\n", static_cast<long>(ctx.rank), key.c_str());
    }
    auto mesh = ctx.mesh(c.ints("mesh"));
    const std::string name = c.str("op");
    const auto dot = name.find('.');
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
        name.substr(0, dot).c_str(), dot == std::string::npos ? "" : name.substr(dot + 1).c_str());
    std::vector<at::Tensor> tensors = make_inputs(ctx, c, mesh);
    std::vector<at::Tensor> outs;
    auto counts = std::make_unique<dtensor::CommDebugMode>();
    try {
      torch::jit::Stack stack = make_stack(op.schema(), c, tensors);
      op.callBoxed(stack);
      outs = c["inplace"].toBool() ? std::vector<at::Tensor>{tensors[0]} : outputs(stack);
    } catch (const std::exception& e) {
      ctx.results.error(key + "#0", e);
      continue;
    }
    for (size_t k = 0; k < outs.size(); ++k) {
      ctx.results.tensor(key + "#" + std::to_string(k), outs[k], k == 0 ? counts.get() : nullptr);
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("ops", run);

} // namespace
} // namespace conformance
