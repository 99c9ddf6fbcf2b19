// The simulated device ([Note: the simulated device]).
#include <atomic>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/SDPBackend.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <dtensor/simulate.h>

#include "mesh/process_group_state.h"

namespace dtensor {

// [Note: the simulated device]
// A simulated world's tensors ([Note: simulated worlds]) have shapes and no values. They
// cannot simply be meta tensors: the dispatcher runs the kernel of the highest backend among
// an op's arguments, the meta backend ranks above PrivateUse1 (dtensor's key), so an op mixing
// a DTensor with a plain meta tensor (a token batch, a gradient made from a DTensor's
// options, a local output) would run ATen's meta kernel on the DTensor's global shape. The
// simulated device is c10's MAIA device type, which LibTorch registers no kernel for and whose
// backend ranks just below PrivateUse1, as the CPU does: its tensors have storages of their
// true size from a counting allocator that holds no memory (the rank's device memory,
// exactly), and every op on them runs ATen's meta kernel on meta stand-ins of the same sizes
// and strides (one boxed fallback), its outputs made again on the simulated device: views
// share their input's storage, in-place and out= results are the arguments themselves
// (resized as the meta kernel resized its stand-in), new results are allocated.

namespace {

std::atomic<int64_t> live{0};
std::atomic<int64_t> peak{0};

struct Counted {
  int64_t bytes;
};

void release(void* ctx) {
  auto* c = static_cast<Counted*>(ctx);
  live.fetch_sub(c->bytes, std::memory_order_relaxed);
  delete c;
}

const c10::Device kSim(detail::kSimulatedDevice, 0);

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, nullptr, kSim};
    }
    const auto bytes = static_cast<int64_t>(n);
    const int64_t now = live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
    return {nullptr, new Counted{bytes}, &release, kSim};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* /*dest*/, const void* /*src*/, size_t /*count*/) const override {}
};

CountingAllocator counting;

const bool allocator_registered = [] {
  c10::SetAllocator(detail::kSimulatedDevice, &counting, /*priority=*/1);
  if (c10::GetAllocator(detail::kSimulatedDevice) != &counting) {
    detail::note_dispatch_key_conflict(
        "the MAIA device already has an allocator of higher priority, registered by another "
        "library; dtensor needs it for the simulated device");
  }
  return true;
}();

// A device guard that does nothing (one simulated device per process).
C10_REGISTER_GUARD_IMPL(MAIA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::MAIA>);

bool on_sim(const at::Tensor& t) {
  return t.defined() && t.device().type() == detail::kSimulatedDevice;
}

at::Tensor stand_in(const at::Tensor& t) {
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

c10::IValue to_meta(const c10::IValue& v) {
  if (v.isTensor()) {
    return on_sim(v.toTensor()) ? c10::IValue(stand_in(v.toTensor())) : v;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) {
      out.push_back(on_sim(t) ? stand_in(t) : t);
    }
    return out;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> out;
    for (const auto& e : v.toOptionalTensorList()) {
      const std::optional<at::Tensor> t = e;
      out.push_back(t && on_sim(*t) ? std::optional<at::Tensor>(stand_in(*t)) : t);
    }
    return out;
  }
  if (v.isDevice() && v.toDevice().type() == detail::kSimulatedDevice) {
    return c10::Device(c10::kMeta);
  }
  return v;
}

// Makes `target` (a simulated tensor) take the meta result's geometry, growing its storage.
void take_geometry(const at::Tensor& target, const at::Tensor& meta) {
  c10::TensorImpl* impl = target.unsafeGetTensorImpl();
  if (impl->sizes() == meta.sizes() && impl->strides() == meta.strides()) {
    return;
  }
  impl->set_sizes_and_strides(meta.sizes(), meta.strides(), impl->storage_offset());
  const size_t need = at::detail::computeStorageNbytes(
      meta.sizes(), meta.strides(), meta.dtype().itemsize(), impl->storage_offset());
  c10::StorageImpl* s = impl->storage().unsafeGetStorageImpl();
  if (s->nbytes() < need) {
    s->set_data_ptr_noswap(counting.allocate(need));
    s->set_nbytes(need);
  }
}

// A view of `base` (simulated) with the geometry of `meta_view` (a view of base's stand-in).
at::Tensor view_of(const at::Tensor& base, const at::Tensor& meta_base,
                   const at::Tensor& meta_view) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(base.storage()), base.key_set(), meta_view.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(
      meta_view.sizes(), meta_view.strides(),
      base.storage_offset() + meta_view.storage_offset() - meta_base.storage_offset());
  return t;
}

at::Tensor fresh(const at::Tensor& meta) {
  return at::detail::empty_strided_generic(meta.sizes(), meta.strides(), &counting,
                                           c10::DispatchKeySet(detail::kSimulatedKey),
                                           meta.scalar_type());
}

// A result of the meta call made a simulated tensor: `alias` is the argument it aliases (if
// the schema says so), with its stand-in.
at::Tensor back(const at::Tensor& meta, const c10::AliasInfo* alias,
                const std::vector<std::pair<c10::IValue, c10::IValue>>& args, bool mutates) {
  if (!meta.defined() || !meta.is_meta()) {
    return meta;
  }
  if (alias != nullptr) {
    for (const auto& [orig, standin] : args) {
      if (orig.isTensor() && on_sim(orig.toTensor()) && standin.isTensor() &&
          standin.toTensor().storage().is_alias_of(meta.storage())) {
        if (mutates) {
          take_geometry(orig.toTensor(), meta);
          return orig.toTensor();
        }
        return view_of(orig.toTensor(), standin.toTensor(), meta);
      }
    }
  }
  return fresh(meta);
}

void sim_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  if (schema.name() == "aten::_copy_from" || schema.name() == "aten::_copy_from_and_resize") {
    // copy_ between devices: nothing to copy; the destination, resized to the source.
    const at::Tensor src = (*stack)[stack->size() - n].toTensor();
    const at::Tensor dst = (*stack)[stack->size() - n + 1].toTensor();
    take_geometry(dst, at::empty_strided(src.sizes(),
                                         dst.sizes() == src.sizes() ? dst.strides() : src.strides(),
                                         dst.options().device(c10::kMeta)));
    torch::jit::drop(*stack, n);
    stack->emplace_back(dst);
    return;
  }
  std::vector<std::pair<c10::IValue, c10::IValue>> args; // (original, stand-in)
  for (size_t i = stack->size() - n; i < stack->size(); ++i) {
    c10::IValue m = to_meta((*stack)[i]);
    args.emplace_back((*stack)[i], m);
    (*stack)[i] = m;
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  const size_t r = schema.returns().size();
  for (size_t k = 0; k < r; ++k) {
    c10::IValue& v = (*stack)[stack->size() - r + k];
    const c10::AliasInfo* alias = schema.returns()[k].alias_info();
    const bool mutates = alias != nullptr && alias->isWrite();
    if (v.isTensor()) {
      v = back(v.toTensor(), alias, args, mutates);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) {
        out.push_back(back(t, alias, args, mutates));
      }
      v = out;
    }
  }
}

at::Tensor sim_empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                     std::optional<at::Layout> /*layout*/, std::optional<at::Device> /*device*/,
                     std::optional<bool> /*pin_memory*/,
                     std::optional<at::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, &counting, c10::DispatchKeySet(detail::kSimulatedKey),
                                   dtype.value_or(at::get_default_dtype_as_scalartype()),
                                   memory_format);
}

at::Tensor sim_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                             std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout> /*layout*/,
                             std::optional<at::Device> /*device*/,
                             std::optional<bool> /*pin_memory*/) {
  return at::detail::empty_strided_generic(size, stride, &counting,
                                           c10::DispatchKeySet(detail::kSimulatedKey),
                                           dtype.value_or(at::get_default_dtype_as_scalartype()));
}

// The attention kernel the CPU would choose for tensors of these sizes, strides and dtypes (a
// simulated rank takes the real run's kernel), asked of the CPU on stand-ins over a dummy
// address (the choice reads shapes, never data; a real allocation of an 8B model's global
// query would be gigabytes). Works on DTensors too: the CPU's choice reads their global sizes.
int64_t sim_fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& mask, double dropout_p,
                             bool is_causal, std::optional<double> scale, bool enable_gqa) {
  static char nowhere[64];
  auto cpu = [](const at::Tensor& t) {
    return at::from_blob(nowhere, t.sizes(), t.strides(),
                         at::TensorOptions().dtype(t.scalar_type()).device(c10::kCPU));
  };
  return at::_fused_sdp_choice(cpu(q), cpu(k), cpu(v),
                               mask ? std::optional<at::Tensor>(cpu(*mask)) : std::nullopt,
                               dropout_p, is_causal, scale, enable_gqa);
}

// [Note: attention on the simulated device]
// scaled_dot_product_attention is composite: it picks its kernel through a DispatchStub that
// knows the CPU and CUDA only, so on the simulated device it would take the math path (a
// different op sequence from the real run's, and one whose plain causal mask cannot meet a
// heads-sharded DTensor). This kernel, at the simulated device's autograd key (where the
// composite one would run), takes the CPU's choice and calls the kernel the CPU run calls; as
// the composite does, it is made of ops that carry their own autograd.
std::optional<at::Tensor> additive_mask(const std::optional<at::Tensor>& mask,
                                        at::ScalarType dtype) {
  if (!mask || mask->scalar_type() != at::kBool) {
    return mask;
  }
  return at::zeros_like(*mask, mask->options().dtype(dtype))
      .masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity());
}

at::Tensor sim_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                    std::optional<double> scale, bool enable_gqa) {
  const auto choice = static_cast<at::SDPBackend>(
      sim_fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa));
  const auto attn_mask = additive_mask(mask, q.scalar_type());
  if (choice == at::SDPBackend::flash_attention) {
    return std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p,
                                                                       is_causal, attn_mask, scale));
  }
  return std::get<0>(at::_scaled_dot_product_attention_math(
      q, k, v, attn_mask, dropout_p, is_causal, std::nullopt, scale, enable_gqa));
}

} // namespace

SimulatedMemoryStats simulated_memory_stats() {
  (void)allocator_registered;
  return {live.load(std::memory_order_relaxed), peak.load(std::memory_order_relaxed)};
}

void reset_simulated_peak_memory() {
  peak.store(live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

TORCH_LIBRARY_IMPL(aten, MAIA, m) {
  m.impl("empty.memory_format", sim_empty);
  m.impl("empty_strided", sim_empty_strided);
  m.impl("_fused_sdp_choice", sim_fused_sdp_choice);
}

namespace {

// DTensors dispatch at PrivateUse1's autograd key whatever their device, and every tensor at
// PrivateUse2's while selective checkpointing's mode is on ([Note: selective checkpointing
// as a dispatch mode]): there the kernel serves simulated tensors and hands the others to
// the composite, as their backend would.
at::Tensor sdpa_above_backends(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                        std::optional<double> scale, bool enable_gqa) {
  if (q.device().type() == detail::kSimulatedDevice) {
    return sim_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("aten::scaled_dot_product_attention", "")
                             .typed<decltype(sim_sdpa)>();
  const auto composite = q.is_cuda() ? c10::DispatchKey::AutogradCUDA : c10::DispatchKey::AutogradCPU;
  return op.redispatch(c10::DispatchKeySet(composite), q, k, v, mask, dropout_p, is_causal, scale,
                       enable_gqa);
}

} // namespace

TORCH_LIBRARY_IMPL(aten, AutogradMAIA, m) {
  m.impl("scaled_dot_product_attention", sim_sdpa);
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("scaled_dot_product_attention", sdpa_above_backends);
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse2, m) {
  m.impl("scaled_dot_product_attention", sdpa_above_backends);
}

namespace {
// [Note: the dispatch keys dtensor occupies]: the token MAIA in the registrations above.
static_assert(detail::kSimulatedKey == c10::DispatchKey::MAIA);
[[maybe_unused]] const bool sim_fallback_registered =
    (detail::register_fallback(detail::kSimulatedKey,
                               torch::CppFunction::makeFromBoxedFunction<&sim_fallback>(),
                               "the simulated device"),
     true);
} // namespace

} // namespace dtensor
