#pragma once

// What the context-parallel methods share: a call's state, the two sequence-split methods'
// attention (methods.cpp: [Note: two methods]) and the head-split ones built around them
// (head_methods.cpp: [Note: Ulysses], [Note: hierarchical]).
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <dtensor/context_parallel.h>
#include <dtensor/device_mesh.h>

namespace dtensor::detail::cp {

// One call's layout, mesh and options, kept for backward.
struct CallState : torch::CustomClassHolder {
  CallState(CpLayout l, DeviceMesh m, bool c, double s)
      : layout(std::move(l)), mesh(std::move(m)), causal(c), scale(s),
        self(mesh.get_local_rank(0)) {}
  CpLayout layout;
  DeviceMesh mesh;
  bool causal;
  double scale;
  int64_t self; // this rank's index in `layout` (0 for Ulysses' whole-sequence layout)
  int64_t rank() const { return self; }
};

// q against every rank's K/V, gathered already: kv [2, B, Hkv, cp * L, d] (rank-major), no
// collective; {out, lse}, differentiable in q and kv.
std::vector<at::Tensor> gathered_attention(const at::Tensor& q, const at::Tensor& kv,
                                           c10::intrusive_ptr<CallState> state);
// The ring over the state's mesh; {out, lse}, differentiable in q, k and v.
std::vector<at::Tensor> ring_attention(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, c10::intrusive_ptr<CallState> state);

// The head-split methods, on a call's checked inputs; `lse` (may be null) receives the
// log-sum-exp in this rank's rows.
at::Tensor ulysses(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const DeviceMesh& mesh, const CpLayout& layout,
                   const ContextParallelOptions& options, double scale, at::Tensor* lse);
at::Tensor hierarchical(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const DeviceMesh& mesh, const CpLayout& layout,
                        const ContextParallelOptions& options, double scale, at::Tensor* lse);

} // namespace dtensor::detail::cp
