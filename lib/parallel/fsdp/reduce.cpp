// A fully_shard unit's gradients: received unsharded from autograd, reduce-scattered once
// per backward (maybe left in flight, [Note: overlap] in fsdp_state.cpp), accumulated into
// the parameters' Shard gradients.
#include <optional>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp> // dtensor::Work held in pending collectives

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>
#include <dtensor/grad_hooks.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "parallel/fsdp/fsdp_collectives.h"
#include "parallel/fsdp/fsdp_state.h"
#include "parallel/grad_hooks_internal.h"

namespace dtensor::detail {

void FSDPParamGroup::on_grad(size_t index, const at::Tensor& dgrad) {
  fsdp_state().queue_final_callback();
  at::NoGradGuard no_grad;
  params.at(index).accumulate_unsharded_grad(dgrad, name);
  if (!requires_gradient_sync) {
    return;
  }
  for (const FSDPParam& p : params) {
    if (p.grad_node && !p.grad_received) {
      return; // more to come; the end of backward reduces what is missing
    }
  }
  reduce_grads();
  if (reshard_after_backward) {
    reshard();
  }
}

bool FSDPParamGroup::has_pending_grads() const {
  for (const FSDPParam& p : params) {
    if (p.unsharded_grad.defined()) {
      return true;
    }
  }
  return false;
}

void FSDPParamGroup::drop_backward_state() {
  for (FSDPParam& p : params) {
    p.unsharded_grad = at::Tensor();
    p.grad_received = false;
  }
  backward_used = false; // its unsharded parameters, or a prefetch in flight, stay valid
}

void FSDPParamGroup::end_backward() {
  extensions_after_backward(*this); // the optimizer step comes
  if (requires_gradient_sync && has_pending_grads()) {
    reduce_grads();
  }
  for (FSDPParam& p : params) {
    p.grad_received = false;
  }
}

void FSDPParamGroup::accumulate_shard_grads(at::Tensor output, const std::vector<bool>& received) {
  const bool keep_low = options.mp_policy().keep_low_precision_grads();
  if (!keep_low && output.scalar_type() != orig_dtype) {
    output = output.to(orig_dtype);
  }
  if (options.offload_policy().offload_to_cpu()) {
    output = output.to(c10::kCPU);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (received[i]) {
      params[i].accumulate_sharded_grad(output);
    }
  }
  for (size_t i = 0; i < params.size(); ++i) { // FSDP2: once .grad is final
    if (received[i]) {
      run_post_accumulate_grad_hooks(params[i].param);
    }
  }
}

void FSDPParamGroup::reduce_grads() {
  at::NoGradGuard no_grad;
  FSDPStateContext& context = fsdp_state().context();
  context.make_room_for_reduce(); // the memory bound ([Note: overlap])
  const CommAllocator& allocate = comm_hook ? CommAllocator() : custom_reduce_scatter.allocate;
  auto pending = std::make_shared<PendingReduce>(
      allocate_comm(*this, shard_size * shard_numel, reduce_dtype, allocate, "reduce-scatter"));
  for (FSDPParam& fp : params) {
    fp.copy_grad_in(pending->input->tensor, shard_numel, shard_size);
  }
  for (FSDPParam& fp : params) {
    pending->received.push_back(fp.unsharded_grad.defined());
    fp.unsharded_grad = at::Tensor(); // copied in: its memory goes now
    fp.grad_received = false;
  }
  reduce_scatter_flat(*this, *pending);
  if (pending->work.completed()) {
    finish_reduce(*pending);
    return;
  }
  context.track_reduce({shared(), std::move(pending)});
}

void FSDPParamGroup::finish_reduce(PendingReduce& pending) {
  at::NoGradGuard no_grad;
  if (finish_reduce_scatter(*this, pending)) {
    accumulate_shard_grads(pending.output, pending.received);
  }
}

} // namespace dtensor::detail
