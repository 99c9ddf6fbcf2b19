// A fully_shard unit's gradients: received unsharded from autograd, reduce-scattered once
// per backward (maybe left in flight, [Note: overlap] in schedule.cpp), accumulated into
// the parameters' Shard gradients.
#include <optional>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp> // dtensor::Work held in pending collectives

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>
#include <dtensor/grad_hooks.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "parallel/fsdp/fsdp.h"
#include "parallel/fsdp/memory.h"
#include "parallel/grad_reduce.h"
#include "parallel/tp/tensor_parallel.h"
#include "tensor/ops/sharding.h"
#include "tensor/redistribute/redistribute.h"

namespace dtensor::detail {

// A reduce-scatter issued and not finished: the buffers it reads and writes live here
// until it completes, with what finishing needs.
struct PendingReduce {
  explicit PendingReduce(at::Tensor in) { input.emplace(std::move(in)); }
  // The unsharded gradients, one rank's part after another; released at issue where the
  // backend copied them ([Note: reduce-scatter input released at issue]).
  std::optional<CommBuffer> input;
  at::Tensor output; // this rank's reduced shard (reduce dtype)
  Work work;         // the reduce-scatter (done already on synchronous paths)
  DivideFactors factors;
  std::vector<bool> received; // which parameters had a gradient
};

void FSDPParamGroup::on_grad(size_t index, const at::Tensor& dgrad) {
  fsdp_queue_final_callback(*this);
  FSDPParam& fp = params.at(index);
  at::NoGradGuard no_grad;
  at::Tensor grad = dgrad;
  if (const DTensorMeta* m = dtensor_meta(dgrad)) {
    // A tensor-parallel gradient: its local part in the parameter's tp placement (Partial
    // ones, e.g. of Replicate norm weights under sequence parallelism, are reduced here).
    // A parameter without tensor parallelism used with DTensor activations took part as
    // Replicate ([Note: plain units next to tensor parallelism]).
    const Placements want =
        fp.tp_spec ? fp.tp_spec->placements : replicate_all(m->spec.mesh.ndim());
    DTENSOR_CHECK(!fp.tp_spec || m->spec.mesh == fp.tp_spec->mesh,
                  "fully_shard({}): gradient of '{}' is a DTensor on {} but the parameter is "
                  "tensor-parallel on {}",
                  name, fp.fqn, m->spec.mesh.to_string(),
                  fp.tp_spec ? fp.tp_spec->mesh.to_string() : "");
    grad = m->spec.placements == want ? m->local : redistribute_local(m->local, m->spec, want);
  } else if (fp.tp_spec && dgrad.sizes() == fp.tp_spec->shape) {
    // Whole and plain ([Note: local outputs] in lib/parallel/tp/tp_dispatch.cpp): this
    // rank's piece.
    grad = dtensor_meta(distribute_tensor(dgrad, fp.tp_spec->mesh, fp.tp_spec->placements,
                                          /*src_data_rank=*/std::nullopt))
               ->local;
  }
  if (fp.unsharded_grad.defined()) {
    fp.unsharded_grad = fp.unsharded_grad + grad; // accumulated without sync before
  } else {
    fp.unsharded_grad = grad.detach();
  }
  fp.grad_received = true;
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
  if (requires_gradient_sync && has_pending_grads()) {
    reduce_grads();
  }
  for (FSDPParam& p : params) {
    p.grad_received = false;
  }
}

void FSDPParamGroup::copy_in_grads(at::Tensor& input) const {
  // Each parameter's segment in rank r's part: its gradient's rows for r, then zeros for
  // the padding; a parameter without a gradient contributes zeros, so every rank issues
  // the same collective. Only what no gradient covers is zeroed.
  for (const FSDPParam& fp : params) {
    for (int64_t r = 0; r < shard_size; ++r) {
      const int64_t rows = fp.unsharded_grad.defined() ? fp.rows_on(r, shard_size) : 0;
      const int64_t start = r * shard_numel + fp.offset;
      if (rows > 0) {
        input.narrow(0, start, rows * fp.row_numel)
            .view(fp.chunk_shape(rows))
            .copy_(fp.unsharded_grad.narrow(fp.shard_dim, r * fp.chunk, rows));
      }
      if (rows < fp.chunk) {
        input.narrow(0, start + rows * fp.row_numel, (fp.chunk - rows) * fp.row_numel).zero_();
      }
    }
  }
}

void FSDPParamGroup::run_all_reduce_hook(at::Tensor& output) const {
  if (!all_reduce_hook) {
    return;
  }
  // [Note: all-reduce hook] FSDP2's place: after the reduce-scatter (and HSDP's
  // all-reduce), before the post-division, the cast back and the copy into the gradients.
  const auto numel = output.numel();
  const auto dtype = output.scalar_type();
  all_reduce_hook(output);
  DTENSOR_CHECK(output.defined() && output.numel() == numel && output.scalar_type() == dtype,
                "fully_shard unit '{}': the all-reduce hook must leave the reduced gradient "
                "a {} tensor of {} elements",
                name, c10::toString(dtype), numel);
}

at::Tensor FSDPParamGroup::reduce_with_hook(at::Tensor& input) {
  const auto& [registered, hook] = *comm_hook;
  const CommHookState hook_state = resolved_hook_state(registered, shard_group);
  at::Tensor output = at::empty({shard_numel}, input.options());
  hook.reduce_scatter(hook_state, input, output);
  DTENSOR_CHECK(output.defined() && output.numel() == shard_numel,
                "fully_shard unit '{}': communication hook '{}' must leave a reduced shard of {} "
                "elements in `output`, got {}",
                name, hook.name, shard_numel, output.defined() ? output.numel() : 0);
  return output.reshape({shard_numel});
}

// [Note: communication hooks on HSDP] FSDP1 refuses register_comm_hook for hybrid
// strategies; here a hook serves HSDP units with both its halves: reduce_scatter over the
// shard dim (state: the registered one, its group the shard group unless given) and
// all_reduce over the replicate dim (state: the replicate group and its own divide
// factors). With the built-in hooks each half averages over its dim, so together they
// average over every data-parallel rank, as native HSDP does.
void FSDPParamGroup::all_reduce_with_hook(at::Tensor& output) {
  const auto& [registered, hook] = *comm_hook;
  at::Tensor reduced = output;
  hook.all_reduce(resolved_hook_state(CommHookState(), *replicate_group), reduced);
  DTENSOR_CHECK(reduced.defined() && reduced.numel() == output.numel(),
                "fully_shard unit '{}': communication hook '{}' must leave the all-reduced shard "
                "of {} elements in its bucket, got {}",
                name, hook.name, output.numel(), reduced.defined() ? reduced.numel() : 0);
  output = reduced.reshape({output.numel()});
}

void FSDPParamGroup::start_reduce_flat(PendingReduce& pending) {
  at::Tensor& input = pending.input->tensor;
  if (comm_hook) {
    pending.output = reduce_with_hook(input);
    return;
  }
  const DivideFactors f = gradient_divide_factors(mesh.size(), reduce_dtype, gradient_divide_factor,
                                                  force_sum_reduction);
  pending.factors = f;
  if (f.premul != 1) {
    input.mul_(f.premul); // NCCL's PreMulSum, emulated: multiply, then SUM
  }
  if (f.pre != 1) {
    input.div_(f.pre);
  }
  pending.output =
      allocate_comm(shard_numel, reduce_dtype, custom_reduce_scatter.allocate, "reduce-scatter");
  if (custom_reduce_scatter.call) {
    custom_reduce_scatter.call(pending.output, input, shard_group, f.reduce_scatter_op);
  } else {
    pending.work = detail::reduce_scatter_tensor_into(pending.output, input, f.reduce_scatter_op,
                                              shard_group, CollectiveOptions().async_op(overlap));
    if (reduce_scatter_input_free_at_issue(shard_group, f.reduce_scatter_op)) {
      pending.input.reset(); // one unit less in flight at the start of backward
    }
  }
}

// [Note: partial reduce output] FSDP2's set_requires_all_reduce(false), for HSDP gradient
// accumulation that reduce-scatters every microbatch (freeing the unsharded gradients) but
// all-reduces over the replicate dim once: each microbatch's reduced shard (pre-divided,
// not all-reduced, not post-divided) is added into partial_reduce_output and .grad is left
// alone; the first reduce with the all-reduce on adds the partial to its own shard and
// all-reduces the sum. Every step is linear, so the result is the all-reduce of the sum.
// As in FSDP2 the partial outlives optimizer steps and zero_grad: the last microbatch of a
// step must have the all-reduce on.
bool FSDPParamGroup::finish_reduce_flat(PendingReduce& pending) {
  pending.work.wait();
  if (replicate_group && !requires_all_reduce) {
    if (partial_reduce_output.defined()) {
      partial_reduce_output.add_(pending.output);
      for (size_t i = 0; i < pending.received.size(); ++i) {
        partial_received[i] = partial_received[i] || pending.received[i];
      }
    } else {
      partial_reduce_output = pending.output;
      partial_received = pending.received;
    }
    return false;
  }
  if (partial_reduce_output.defined()) {
    pending.output.add_(partial_reduce_output);
    for (size_t i = 0; i < pending.received.size(); ++i) {
      pending.received[i] = pending.received[i] || partial_received[i];
    }
    partial_reduce_output = at::Tensor();
    partial_received.clear();
  }
  if (comm_hook) { // the hook divided; [Note: communication hooks on HSDP]
    if (replicate_group) {
      all_reduce_with_hook(pending.output);
    }
    run_all_reduce_hook(pending.output);
    return true;
  }
  const DivideFactors& f = pending.factors;
  if (replicate_group) {
    detail::all_reduce_(pending.output, f.all_reduce_op, *replicate_group);
  }
  run_all_reduce_hook(pending.output);
  if (f.post != 1) {
    pending.output.div_(f.post);
  }
  return true;
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
    if (!received[i]) {
      continue;
    }
    FSDPParam& fp = params[i];
    at::Tensor local = output.narrow(0, fp.offset, fp.local_rows * fp.row_numel)
                           .view(fp.chunk_shape(fp.local_rows));
    at::Tensor& g = fp.param.mutable_grad();
    if (g.defined()) {
      const DTensorMeta& m = checked_meta(g, "fully_shard gradient accumulation");
      m.local.add_(local);
    } else {
      DTensorSpec spec = fp.spec;
      spec.dtype = local.scalar_type();
      g = make_dtensor(local, spec);
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
  fsdp_make_room_for_reduce(context()); // the memory bound ([Note: overlap])
  const CommAllocator& allocate = comm_hook ? CommAllocator() : custom_reduce_scatter.allocate;
  auto pending = std::make_shared<PendingReduce>(
      allocate_comm(shard_size * shard_numel, reduce_dtype, allocate, "reduce-scatter"));
  copy_in_grads(pending->input->tensor);
  for (FSDPParam& fp : params) {
    pending->received.push_back(fp.unsharded_grad.defined());
    fp.unsharded_grad = at::Tensor(); // copied in: its memory goes now
    fp.grad_received = false;
  }
  start_reduce_flat(*pending);
  if (pending->work.completed()) {
    finish_reduce(*pending);
    return;
  }
  fsdp_track_reduce(context(), {shared_from_this(), std::move(pending)});
}

void FSDPParamGroup::finish_reduce(PendingReduce& pending) {
  at::NoGradGuard no_grad;
  if (finish_reduce_flat(pending)) {
    accumulate_shard_grads(pending.output, pending.received);
  }
}

} // namespace dtensor::detail
