// The FLOP counter: RecordFunction callbacks on the matrix products and attention kernels.
// RecordFunction::inputs() needs the library built with NDEBUG, as LibTorch is ([Note:
// NDEBUG] in meson.build).
#ifndef NDEBUG
#error                                                                                             \
    "dtensor is built with NDEBUG, as LibTorch is ([Note: NDEBUG] in meson.build): configure with -Db_ndebug=true"
#endif
#include "sim/flop_counter.h"

#include <atomic>
#include <cmath>
#include <string_view>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include "mesh/comm_debug.h"
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
//
// Beside them, the work: the FLOPs the kernels execute. They are the same except for an
// attention kernel called with is_causal, whose masked part a fused kernel skips (a flash
// kernel's tiles above the diagonal): it does 4 b h d per (query, key) pair it keeps, the
// lower triangle of (s_q, s_kv) as PyTorch aligns is_causal (top left). Context parallelism's
// methods differ here: all-gather and ring call the kernel on the blocks a query needs,
// Ulysses on the whole sequence with is_causal, so counted as FlopCounterMode counts them
// Ulysses would seem to compute twice the attention. The time model uses the work.
std::atomic<int64_t> flops_counted{0};
std::atomic<int64_t> work_counted{0};

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

// The share of (s_q x s_kv) pairs a top-left causal mask keeps.
double causal_share(const at::Tensor* q, const at::Tensor* k) {
  if (q == nullptr || k == nullptr || q->dim() != 4 || k->dim() != 4) {
    return 1.0;
  }
  const double sq = static_cast<double>(q->size(2)), sk = static_cast<double>(k->size(2));
  const double kept = sq <= sk ? sq * (sq + 1) / 2 : sk * (sk + 1) / 2 + (sq - sk) * sk;
  return sq * sk > 0 ? kept / (sq * sk) : 1.0;
}

// The op's is_causal argument, found by name in its schema (false when it has none).
bool is_causal_call(const at::RecordFunction& fn, c10::ArrayRef<const c10::IValue> in) {
  const auto op = c10::Dispatcher::singleton().findSchema(
      {std::string(fn.name()), std::string(fn.overload_name())});
  if (!op) {
    return false;
  }
  const auto& args = op->schema().arguments();
  for (size_t i = 0; i < args.size() && i < in.size(); ++i) {
    if (args[i].name() == "is_causal") {
      return in[i].isBool() && in[i].toBool();
    }
  }
  return false;
}

struct Counted {
  int64_t flops = 0;
  int64_t work = 0;
};

Counted op_flops(const at::RecordFunction* fn, const std::string_view name,
                 c10::ArrayRef<const c10::IValue> in) {
  if (name == "aten::mm" || name == "aten::bmm") {
    const int64_t n = product_flops(tensor_at(in, 0), tensor_at(in, 1));
    return {n, n};
  }
  if (name == "aten::addmm" || name == "aten::baddbmm") {
    const int64_t n = product_flops(tensor_at(in, 1), tensor_at(in, 2));
    return {n, n};
  }
  const bool attention = name.find("aten::_scaled_dot_product_") == 0 ||
                         name.find("aten::_efficient_attention") == 0 ||
                         name.find("aten::_flash_attention") == 0;
  if (!attention || name.find("attention_math") != std::string_view::npos ||
      name.find("fused_sdp_choice") != std::string_view::npos) {
    return {}; // the math path's bmm's count themselves
  }
  const bool backward = name.size() > 9 && name.substr(name.size() - 9) == "_backward";
  const at::Tensor* q = tensor_at(in, backward ? 1 : 0); // (grad_out, q, k, ...) backward
  const at::Tensor* k = tensor_at(in, backward ? 2 : 1);
  const int64_t n = (backward ? 2 : 1) * attention_flops(q, k);
  const bool causal = fn != nullptr && n > 0 && is_causal_call(*fn, in);
  return {n, causal ? std::llround(static_cast<double>(n) * causal_share(q, k)) : n};
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
  if (op_flops(nullptr, name, {}).flops == 0 && name != "aten::mm" && name != "aten::bmm" &&
      name != "aten::addmm" && name != "aten::baddbmm" &&
      name.find("attention") == std::string_view::npos) {
    return nullptr; // not an op that counts (and other ranges may carry no inputs)
  }
  if (std::string_view(fn.overload_name()) == "out") {
    return nullptr; // on the simulated device a functional op runs as its out= overload
  }
  const auto in = fn.inputs();
  const Counted n = op_flops(&fn, name, in);
  if (n.flops > 0 && !is_dtensor_call(in)) {
    flops_counted.fetch_add(n.flops, std::memory_order_relaxed);
    work_counted.fetch_add(n.work, std::memory_order_relaxed);
  }
  return nullptr;
}

int64_t work_so_far() {
  return work_counted.load(std::memory_order_relaxed);
}

} // namespace

uint64_t start_counting_flops() {
  flops_counted.store(0);
  work_counted.store(0);
  set_issue_stamp(&work_so_far);
  return at::addThreadLocalCallback(at::RecordFunctionCallback(&count_flops)
                                        .needsInputs(true)
                                        .scopes({at::RecordScope::FUNCTION}));
}

void stop_counting_flops(uint64_t handle) {
  set_issue_stamp(nullptr);
  at::removeCallback(handle);
}

CountedFlops take_flops() {
  return {flops_counted.exchange(0), work_counted.exchange(0)};
}

} // namespace dtensor::detail
