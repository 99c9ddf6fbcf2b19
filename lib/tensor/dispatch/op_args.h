#pragma once

// Walking and rewriting an op's arguments on the boxed stack: one home for what the generic
// handler and every interceptor (lib/tensor/dispatch/interceptors.h) need.
#include <cstddef>
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <dtensor/device_mesh.h>

namespace dtensor::detail {

// The op's arguments: the last `schema.arguments().size()` entries of the stack.
struct OpArgs {
  OpArgs(const c10::OperatorHandle& op, torch::jit::Stack* stack);
  const c10::FunctionSchema& schema;
  torch::jit::Stack* stack;
  size_t count; // number of arguments
  size_t base;  // stack index of argument 0

  c10::IValue& operator[](size_t i) const { return (*stack)[base + i]; }
  // Calls f(arg, element, tensor) for every tensor argument (element -1) and every element
  // of a tensor-list argument (element = its index; in a list of optional tensors, Tensor?[]
  // as index's indices, the index among all entries, None ones skipped).
  template <class F>
  void for_each_tensor(F&& f) const {
    for (size_t i = 0; i < count; ++i) {
      const c10::IValue& v = (*this)[i];
      if (v.isTensor()) {
        f(i, int64_t{-1}, v.toTensor());
      } else if (v.isTensorList()) {
        int64_t e = 0;
        for (const at::Tensor& t : v.toTensorVector()) {
          f(i, e++, t);
        }
      } else if (v.isList() && !v.isIntList()) {
        int64_t e = 0;
        for (const c10::IValue& x : v.toListRef()) {
          if (x.isTensor()) {
            f(i, e, x.toTensor());
          }
          ++e;
        }
      }
    }
  }
  // Replaces argument `arg` (element -1) or one element of a tensor-list argument.
  void set(size_t arg, int64_t element, const at::Tensor& value) const;
  bool writes(size_t arg) const; // the schema marks it written (in-place / out)
  const std::string& name_of(size_t arg) const { return schema.arguments()[arg].name(); }
};

// slot = value, out of line: inlined, GCC 12 reports a false stringop-overflow in IValue's
// refcounting.
void assign_ivalue(c10::IValue& slot, c10::IValue value);

// The argument a non-writing return aliases (a view), or -1.
int64_t aliased_argument(const c10::FunctionSchema& schema, size_t ret);

// A plain tensor taken as Replicate on every dimension of `mesh` (same shape and strides).
at::Tensor as_replicate(const at::Tensor& plain, const DeviceMesh& mesh);

// Whether autograd's engine is running a backward pass on this thread.
bool in_backward();

// [Note: recompute is forward for tensor parallelism] Activation checkpointing runs a
// function's forward again inside backward (lib/train/activation_checkpoint/). While a
// RecomputeGuard lives on the thread, in_recompute() is true: tensor parallelism then
// treats ops as forward ops (the same redistributions and collectives as the first
// forward), while fully_shard still sees a backward use of its units (in_backward()): the
// recompute is where backward needs the unit unsharded, as FSDP2's pre-backward hook does.
bool in_recompute();
class RecomputeGuard {
 public:
  RecomputeGuard();
  ~RecomputeGuard();
  RecomputeGuard(const RecomputeGuard&) = delete;
  RecomputeGuard& operator=(const RecomputeGuard&) = delete;

 private:
  bool previous_;
};

// While a CheckpointForwardGuard lives on the thread (activation checkpointing's first
// forward, run without autograd), in_checkpoint_forward() is true: what the forward leaves to
// its backward (expert parallelism's overflow check) waits for the recompute, which runs in it.
bool in_checkpoint_forward();
class CheckpointForwardGuard {
 public:
  CheckpointForwardGuard();
  ~CheckpointForwardGuard();
  CheckpointForwardGuard(const CheckpointForwardGuard&) = delete;
  CheckpointForwardGuard& operator=(const CheckpointForwardGuard&) = delete;

 private:
  bool previous_;
};

// "aten::add.Tensor": built once per operator and thread ([Note: per-op statics] in
// lib/tensor/dispatch/op_args.cpp), so the dispatch path may ask for it on every op.
const std::string& op_full_name(const c10::OperatorHandle& op);

} // namespace dtensor::detail
