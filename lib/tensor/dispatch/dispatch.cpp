// The DTensor dispatch handler: one boxed kernel for every aten op reaching PrivateUse1. Its
// steps are here ([Note: the handler's steps]); the decision (keys, cache, rule, plans) is in
// decision.cpp, the outputs' global geometry in output_geometry.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/SmallVector.h>
#include <c10/util/accumulate.h>

#include "internal/check.h"
#include "mesh/comm_debug.h"
#include "tensor/debug/torch_repr.h"
#include "tensor/dispatch/decision.h"
#include "tensor/dispatch/decompose.h"
#include "tensor/dispatch/handler.h"
#include "tensor/dispatch/interceptors.h"
#include "tensor/dispatch/op_args.h"
#include "tensor/dtensor_impl.h"
#include "tensor/ops/rule.h"
#include "tensor/redistribute/redistribute.h"

namespace dtensor::detail {

namespace {

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

// Wrap: local results become DTensors (in-place and out= returns are their DTensor
// arguments again), each finished by the interceptors that asked to.
void wrap_outputs(const c10::OperatorHandle& op, const OpInfo& info, const Cached& decision,
                  torch::jit::Stack* stack, const std::vector<OutputFinisher>& finishers) {
  const auto& schema = op.schema();
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  // Results whose global shapes come from the decision have their local shapes checked on
  // its first use only; those taken from the local results, every time.
  const bool check =
      decision.shapes_from_local || !decision.outputs_checked.load(std::memory_order_relaxed);
  auto wrap = [&](size_t r, size_t element, at::Tensor local) {
    DTensorSpec spec = output_spec(info, decision, r, element, local);
    // [Note: empty shards] Some kernels return an input with no elements as it is
    // (pixel_unshuffle on an empty batch shard): no values are lost by giving it the shape
    // the output's spec says this rank holds, also empty.
    if (local.numel() == 0) {
      const std::vector<int64_t> want = spec.local_shape();
      if (local.sizes() != c10::IntArrayRef(want) && c10::multiply_integers(want) == 0) {
        local = at::empty(want, local.options());
      }
    }
    at::Tensor out = make_dtensor_from_result(std::move(local), std::move(spec), check);
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
      slot = wrap(r, 0, std::move(slot).toTensor());
    } else if (slot.isTensorList()) {
      c10::List<at::Tensor> wrapped;
      size_t e = 0;
      for (at::Tensor t : slot.toTensorVector()) { // held by the list too: detached
        wrapped.push_back(wrap(r, e++, std::move(t)));
      }
      slot = wrapped;
    }
  }
  decision.outputs_checked.store(true, std::memory_order_relaxed);
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
  // this copy keeps the DTensors, whose specs info.specs points into, alive), held inline for
  // ops of up to eight arguments: no allocation.
  const c10::SmallVector<c10::IValue, 8> args(stack->begin() + static_cast<std::ptrdiff_t>(a.base),
                                              stack->end());
  OpInfo info;
  info.op = &op;
  info.name = op_full_name(op);
  info.args = args;
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

} // namespace dtensor::detail
