// The FLOP counter: RecordFunction callbacks on the matrix products and attention kernels.
// RecordFunction::inputs() needs the library built with NDEBUG, as LibTorch is ([Note:
// NDEBUG] in meson.build).
#ifndef NDEBUG
#error                                                                                             \
    "dtensor is built with NDEBUG, as LibTorch is ([Note: NDEBUG] in meson.build): configure with -Db_ndebug=true"
#endif
#include "sim/flop_counter.h"

#include <atomic>
#include <string_view>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "mesh/dispatch_keys.h"
#include "tensor/dispatch/handler.h"

namespace dtensor::detail {

namespace {

// [Note: FLOPs]
// A step's FLOPs are those of its matrix products and attention kernels, as PyTorch's
// FlopCounterMode counts them: 2mnk for an (m x k) @ (k x n) product (mm, addmm, bmm,
// baddbmm), 4 b h s_q s_kv d for an attention forward and twice that for its backward
// (the fused kernels; on meta tensors attention decomposes into the same bmm's). They are
// counted on the local tensors each rank computes with, from RecordFunction callbacks on
// the recording thread and the autograd threads it starts (at::ThreadLocalState carries
// them); the DTensor-level call of an op (PrivateUse1), the handler's shape inference on
// global shapes and out= overloads (which the simulated device's functional ops call, as
// structured kernels do off CPU and CUDA) are left out. Elementwise ops are not counted (as
// FlopCounterMode).
std::atomic<int64_t> flops_counted{0};

int64_t numel_of(c10::IntArrayRef sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    n *= s;
  }
  return n;
}

const at::Tensor* tensor_at(c10::ArrayRef<const c10::IValue> in, size_t i) {
  return i < in.size() && in[i].isTensor() ? &in[i].toTensor() : nullptr;
}

// 2 * (product of a's dims) * b's last dim, for a (..., m, k) @ (..., k, n) product.
int64_t product_flops(const at::Tensor* a, const at::Tensor* b) {
  if (a == nullptr || b == nullptr || a->dim() < 2 || b->dim() < 2) {
    return 0;
  }
  return 2 * numel_of(a->sizes()) * b->size(-1);
}

// q (b, h, s_q, d), k (b, h_kv, s_kv, d): 4 b h s_q s_kv d.
int64_t attention_flops(const at::Tensor* q, const at::Tensor* k) {
  if (q == nullptr || k == nullptr || q->dim() != 4 || k->dim() != 4) {
    return 0;
  }
  return 4 * numel_of(q->sizes()) * k->size(2);
}

int64_t op_flops(const std::string_view name, c10::ArrayRef<const c10::IValue> in) {
  if (name == "aten::mm" || name == "aten::bmm") {
    return product_flops(tensor_at(in, 0), tensor_at(in, 1));
  }
  if (name == "aten::addmm" || name == "aten::baddbmm") {
    return product_flops(tensor_at(in, 1), tensor_at(in, 2));
  }
  const bool attention = name.find("aten::_scaled_dot_product_") == 0 ||
                         name.find("aten::_efficient_attention") == 0 ||
                         name.find("aten::_flash_attention") == 0;
  if (!attention || name.find("attention_math") != std::string_view::npos ||
      name.find("fused_sdp_choice") != std::string_view::npos) {
    return 0; // the math path's bmm's count themselves
  }
  if (name.size() > 9 && name.substr(name.size() - 9) == "_backward") {
    return 2 * attention_flops(tensor_at(in, 1), tensor_at(in, 2)); // (grad_out, q, k, ...)
  }
  return attention_flops(tensor_at(in, 0), tensor_at(in, 1));
}

bool is_dtensor_call(c10::ArrayRef<const c10::IValue> in) {
  for (const auto& v : in) {
    if (v.isTensor() && v.toTensor().defined() &&
        v.toTensor().key_set().has(kDTensorKey)) {
      return true;
    }
  }
  return false;
}

std::unique_ptr<at::ObserverContext> count_flops(const at::RecordFunction& fn) {
  if (in_shape_inference()) {
    return nullptr;
  }
  const std::string_view name = fn.name();
  if (op_flops(name, {}) == 0 && name != "aten::mm" && name != "aten::bmm" &&
      name != "aten::addmm" && name != "aten::baddbmm" &&
      name.find("attention") == std::string_view::npos) {
    return nullptr; // not an op that counts (and other ranges may carry no inputs)
  }
  if (std::string_view(fn.overload_name()) == "out") {
    return nullptr; // on the simulated device a functional op runs as its out= overload
  }
  const auto in = fn.inputs();
  const int64_t n = op_flops(name, in);
  if (n > 0 && !is_dtensor_call(in)) {
    flops_counted.fetch_add(n, std::memory_order_relaxed);
  }
  return nullptr;
}

} // namespace

uint64_t start_counting_flops() {
  flops_counted.store(0);
  return at::addThreadLocalCallback(at::RecordFunctionCallback(&count_flops)
                                        .needsInputs(true)
                                        .scopes({at::RecordScope::FUNCTION}));
}

void stop_counting_flops(uint64_t handle) {
  at::removeCallback(handle);
}

int64_t take_flops() {
  return flops_counted.exchange(0);
}

} // namespace dtensor::detail
