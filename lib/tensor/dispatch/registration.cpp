// Registration of the DTensor kernels on PrivateUse1: the handler for every aten op that
// would otherwise run a composite kernel on a DTensor, the fallback for the rest, and the few
// ops that need more than the handler (_reshape_alias, in-place view ops).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <set>
#include <string>

#include "internal/check.h"
#include "mesh/dispatch_keys.h"
#include "tensor/dispatch/handler.h"
#include "tensor/dtensor_impl.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

// [Note: what reaches the handler]
// DTensors carry the PrivateUse1 backend bit, so the dispatcher sends every op on them,
// after autograd, to PrivateUse1. The boxed fallback below catches ops without a kernel
// there. But an op with a CompositeExplicitAutograd(NonFunctional) kernel would run that
// kernel on the DTensor instead (views become as_strided with global strides, structured
// ops allocate plain outputs), so the same handler is registered directly on PrivateUse1
// for every such aten op that has no CompositeImplicitAutograd kernel (those decompose
// above autograd into ops we do see, e.g. linear -> t + addmm). The list is read from the
// dispatcher when the first DTensor is made.

// [Note: _reshape_alias]
// reshape() of a viewable tensor calls _reshape_alias(self, size, stride) with strides
// computed from the global sizes and strides. The local tensor needs strides computed from
// its own: the op runs as view(self, size), whose rule and local kernel do exactly that.
void reshape_alias_as_view(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const c10::OperatorHandle view =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::view", "");
  stack->pop_back(); // stride
  view.callBoxed(*stack);
}

// [Note: in-place view ops]
// squeeze_, unsqueeze_, transpose_ and t_ change the metadata of the tensor they are given.
// On a DTensor that is its spec and its local tensor: the functional view runs through the
// handler (its rule decides the placements, e.g. a shard dim renumbered or a size-1 shard
// kept as it is), and the DTensor takes the view's sizes, strides, spec and local tensor.
// Other handles to the same data keep theirs, as for a plain tensor; the new state is a new
// DTensorMeta with the old one's extensions, not an edit of the shared one.
const std::set<std::string>& inplace_view_ops() {
  static const std::set<std::string> ops = {"aten::squeeze_", "aten::unsqueeze_",
                                            "aten::transpose_", "aten::t_"};
  return ops;
}

void inplace_view(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const at::Tensor self = (*stack)[stack->size() - nargs].toTensor();
  const DTensorMeta& before = checked_meta(self, schema.name().c_str());
  std::string name = schema.name();
  name.pop_back(); // squeeze_ -> squeeze
  // The functional overload has the in-place one's name, but transpose_ -> transpose.int.
  const std::string overload = name == "aten::transpose" ? "int" : schema.overload_name();
  const c10::OperatorHandle view =
      c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  torch::jit::Stack args(stack->end() - static_cast<std::ptrdiff_t>(nargs), stack->end());
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    view.callBoxed(args);
  }
  const DTensorMeta& after = checked_meta(args.back().toTensor(), name.c_str());
  auto meta = c10::make_intrusive<DTensorMeta>();
  meta->local = after.local;
  meta->spec = after.spec;
  meta->copy_extensions_from(before);
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  const bool allowed = impl->allow_tensor_metadata_change();
  impl->set_allow_tensor_metadata_change(true);
  impl->set_sizes_and_strides(meta->spec.shape, meta->spec.stride);
  impl->set_allow_tensor_metadata_change(allowed);
  impl->set_backend_meta(meta);
  torch::jit::drop(*stack, nargs);
  stack->emplace_back(self);
}

bool is_inplace_view(const c10::OperatorName& name) {
  return inplace_view_ops().count(name.name) != 0;
}

} // namespace

void ensure_dispatch_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    static std::unique_ptr<torch::Library> lib = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", kDTensorKey, __FILE__, __LINE__);
    auto& d = c10::Dispatcher::singleton();
    std::vector<std::string> foreign; // aten kernels at dtensor's key before it registers any
    for (const auto& name : d.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) {
        continue;
      }
      auto h = d.findOp(name);
      if (!h) {
        continue;
      }
      bool explicit_composite =
          h->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          h->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
      if (h->hasKernelForDispatchKey(kDTensorKey)) {
        foreign.push_back(c10::toString(name));
        continue;
      }
      if (!explicit_composite || is_inplace_view(name) ||
          h->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
        continue;
      }
      std::string op =
          name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
      lib->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&handler>());
    }
    lib->impl("_reshape_alias",
              torch::CppFunction::makeFromBoxedFunction<&reshape_alias_as_view>());
    for (const auto& name : d.getAllOpNames()) {
      if (is_inplace_view(name)) {
        std::string op =
            name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
        lib->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&inplace_view>());
      }
    }
    if (!foreign.empty()) {
      note_dispatch_key_conflict(fmt::format(
          "{} aten ops already have a kernel at PrivateUse1, registered by another library "
          "(first: {}); dtensor needs the key for DTensor's handler",
          foreign.size(), foreign.front()));
    }
    register_fallback(kDTensorKey, torch::CppFunction::makeFromBoxedFunction<&handler>(),
                      "DTensor's handler");
    register_builtin_rules();
  });
}

void route_to_handler(const std::string& op) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<torch::Library>> libraries; // by namespace
  const auto colon = op.find("::");
  const auto dot = op.find('.');
  const std::string base = op.substr(0, dot);
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name != base ||
        (dot != std::string::npos && name.overload_name != op.substr(dot + 1))) {
      continue;
    }
    auto h = c10::Dispatcher::singleton().findOp(name);
    // [Note: what reaches the handler]: a composite kernel would otherwise run on the DTensor.
    if (!h || h->hasKernelForDispatchKey(kDTensorKey) ||
        !(h->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          h->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))) {
      continue;
    }
    const std::string ns = base.substr(0, colon);
    auto& lib = libraries[ns];
    if (lib == nullptr) {
      lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, kDTensorKey, __FILE__,
                                             __LINE__);
    }
    const std::string local =
        name.name.substr(colon + 2) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    lib->impl(local.c_str(), torch::CppFunction::makeFromBoxedFunction<&handler>());
  }
}

} // namespace dtensor::detail

namespace {
// Loading the library registers the handler (its kernels and its fallback at kDTensorKey:
// [Note: the dispatch keys dtensor occupies]) and the rules (LibTorch, loaded first, has
// registered every aten op by then); nothing has to happen when a DTensor is made.
[[maybe_unused]] const bool dispatch_registered =
    (dtensor::detail::ensure_dispatch_registered(), true);
} // namespace
