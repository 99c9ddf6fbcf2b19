// Scenario "ops" (sc_ops.py): each case calls one aten op through the dispatcher on
// DTensors made with from_local, from the argument list the Python side wrote.
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>

#include <ATen/core/dispatch/Dispatcher.h>

#include "oracle.h"

namespace conformance::sc_ops {
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

// An argument as the schema wants it: {"t": i} is the i-th tensor, {"tl": [i or None]} a
// tensor list (Tensor[] or Tensor?[]), {"dtype" | "mf" | "layout" | "device": v} the enum or
// device opinfo_record.py encoded, anything else a plain value.
c10::IValue decode(const c10::IValue& v, const c10::TypePtr& type,
                   const std::vector<at::Tensor>& tensors) {
  if (!v.isGenericDict()) {
    return typed(v, type);
  }
  const auto d = v.toGenericDict();
  const auto tensor = [&](const c10::IValue& i) {
    return tensors.at(static_cast<size_t>(i.toInt()));
  };
  if (d.contains("t")) {
    return tensor(d.at("t"));
  }
  if (d.contains("tl")) {
    const c10::IValue idx = d.at("tl");
    c10::TypePtr elem = type;
    if (auto opt = elem->cast<c10::OptionalType>()) {
      elem = opt->getElementType();
    }
    if (auto list = elem->cast<c10::ListType>();
        list != nullptr && list->getElementType()->cast<c10::OptionalType>() != nullptr) {
      c10::List<std::optional<at::Tensor>> out;
      for (const auto& i : idx.toListRef()) {
        out.push_back(i.isNone() ? std::nullopt : std::optional<at::Tensor>(tensor(i)));
      }
      return out;
    }
    c10::List<at::Tensor> out;
    for (const auto& i : idx.toListRef()) {
      out.push_back(tensor(i));
    }
    return out;
  }
  if (d.contains("dtype")) {
    return static_cast<c10::ScalarType>(d.at("dtype").toInt());
  }
  if (d.contains("mf")) {
    return static_cast<c10::MemoryFormat>(d.at("mf").toInt());
  }
  if (d.contains("layout")) {
    return static_cast<c10::Layout>(d.at("layout").toInt());
  }
  return c10::Device(d.at("device").toStringRef());
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
    stack.push_back(decode(given[a], arg.type(), tensors));
  }
  return stack;
}

// The outputs in order: tensors, each element of a tensor list, and (the sweep) scalars.
std::vector<c10::IValue> outputs(const torch::jit::Stack& stack) {
  std::vector<c10::IValue> out;
  for (const c10::IValue& v : stack) {
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) {
        out.emplace_back(t);
      }
    } else if (v.isTensor() || v.isDouble() || v.isInt() || v.isBool()) {
      out.push_back(v);
    }
  }
  return out;
}

c10::OperatorHandle find_op(const std::string& name) {
  const auto dot = name.find('.');
  return c10::Dispatcher::singleton().findSchemaOrThrow(
      name.substr(0, dot).c_str(), dot == std::string::npos ? "" : name.substr(dot + 1).c_str());
}

// The case's key; with CONFORMANCE_TRACE set, each rank says which case it starts.
std::string case_key(const Ctx& ctx, const Case& c) {
  std::string key = c.str("key");
  if (std::getenv("CONFORMANCE_TRACE") != nullptr) {
    std::fprintf(stderr, "[rank %ld] %s\n", static_cast<long>(ctx.rank), key.c_str());
  }
  return key;
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string key = case_key(ctx, c);
    auto mesh = ctx.mesh(c.ints("mesh"));
    const auto op = find_op(c.str("op"));
    std::vector<at::Tensor> tensors = make_inputs(ctx, c, mesh);
    std::vector<c10::IValue> outs;
    auto counts = std::make_unique<dtensor::CommDebugMode>();
    try {
      torch::jit::Stack stack = make_stack(op.schema(), c, tensors);
      op.callBoxed(stack);
      outs = c["inplace"].toBool() ? std::vector<c10::IValue>{tensors[0]} : outputs(stack);
    } catch (const std::exception& e) {
      ctx.results.error(key + "#0", e);
      continue;
    }
    for (size_t k = 0; k < outs.size(); ++k) {
      ctx.results.tensor(key + "#" + std::to_string(k), outs[k].toTensor(),
                         k == 0 ? counts.get() : nullptr);
    }
  }
}

// The operator sweep (sc_sweep.py): as run() without counts; scalar outputs are values, and
// the ranks agree on an error before the next case (a local kernel may fail on one rank's
// shard only: the others must not go on to the next case's collectives alone).
void sweep(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string key = case_key(ctx, c);
    auto mesh = ctx.mesh(c.ints("mesh"));
    std::vector<c10::IValue> outs;
    std::optional<std::string> err;
    try {
      const auto op = find_op(c.str("op"));
      std::vector<at::Tensor> tensors = make_inputs(ctx, c, mesh);
      torch::jit::Stack stack = make_stack(op.schema(), c, tensors);
      op.callBoxed(stack);
      outs = c["inplace"].toBool() ? std::vector<c10::IValue>{tensors[0]} : outputs(stack);
    } catch (const std::exception& e) {
      err = e.what();
    }
    err = ctx.agree_error(err);
    if (!err) {
      try { // full_tensor's collectives, once every rank has its outputs
        for (const c10::IValue& v : outs) {
          if (v.isTensor() && dtensor::is_dtensor(v.toTensor())) {
            (void)DTensor(v.toTensor()).full_tensor();
          }
        }
      } catch (const std::exception& e) {
        err = e.what();
      }
      err = ctx.agree_error(err);
    }
    if (err) {
      ctx.results.error(key + "#0", std::runtime_error(*err));
      continue;
    }
    for (size_t k = 0; k < outs.size(); ++k) {
      const std::string rkey = key + "#" + std::to_string(k);
      if (outs[k].isTensor()) {
        ctx.results.tensor(rkey, outs[k].toTensor());
      } else {
        ctx.results.value(rkey, outs[k]);
      }
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("ops", run) &&
                                         register_scenario("sweep", sweep) &&
                                         register_scenario("sweep_full", sweep);

} // namespace
} // namespace conformance::sc_ops
