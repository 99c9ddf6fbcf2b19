// fully_shard's collectives (fsdp_collectives.h).
#include "parallel/fsdp/fsdp_collectives.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp> // dtensor::Work held in pending collectives

#include "internal/check.h"
#include "mesh/collectives_internal.h"

namespace dtensor::detail {

at::Tensor allocate_comm(const FSDPParamGroup& group, int64_t numel, c10::ScalarType dtype,
                         const CommAllocator& allocate, const char* what) {
  if (!allocate) {
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(group.device));
  }
  at::Tensor t = allocate({numel}, dtype, group.device);
  DTENSOR_CHECK(t.defined() && t.numel() == numel && t.scalar_type() == dtype &&
                    t.device() == group.device,
                "fully_shard unit '{}': the custom {}'s allocate must give a {} tensor of {} "
                "elements on {}",
                group.name, what, c10::toString(dtype), numel, group.device.str());
  return t.view({numel});
}

namespace {

// [Note: all-gather into place]
// The usual all-gather fills a buffer of every rank's flat shard, from which each
// parameter's rows are copied out into the unsharded buffer. ProcessGroupGloo gathers into
// a temporary of its own and copies that into our buffer first, so the data is copied
// twice after the transfer. When every parameter's rows split evenly (no padding), the
// pieces can name their final places instead: rank r's piece i is parameter i's rows
// [r * chunk, (r + 1) * chunk) in the unsharded buffer, and Gloo's allgather_coalesced
// copies each piece there itself, on its own thread, while compute goes on. One copy
// fewer, no communication buffer, same collective count. Only for an all-gather waited for
// where it is issued: while one is in flight (a prefetch), allgather_coalesced holds flat
// temporaries of its input and output besides the unsharded buffer it fills, about 2.5
// units where the buffer path holds one -- measured at the start of backward, where the
// activations peak, as 4.7 MB above PyTorch FSDP2's peak for the d = 256 Transformer of
// bench/activation_checkpoint (docs/benchmarks.md); with the buffer path the peaks are
// equal to the byte. Elsewhere (prefetches, padding, NCCL, a custom all-gather) the buffer
// and copy-out stay.
bool gathers_in_place(const FSDPParamGroup& group) {
  if (group.custom_all_gather.call || group.shard_group.backend_type() != BackendType::Gloo ||
      at::isComplexType(group.param_dtype)) {
    return false;
  }
  for (const FSDPParam& fp : group.params) {
    if (fp.chunk == 0 ||
        fp.chunk * group.shard_size != fp.shape[static_cast<size_t>(fp.shard_dim)]) {
      return false;
    }
  }
  return true;
}

Work gather_in_place(FSDPParamGroup& group, const at::Tensor& input) {
  allocate_storage(group.unsharded_flat);
  std::vector<at::Tensor> inputs;
  std::vector<std::vector<at::Tensor>> outputs(static_cast<size_t>(group.shard_size));
  for (const FSDPParam& fp : group.params) {
    inputs.push_back(input.narrow(0, fp.offset, fp.segment_numel()).view(fp.chunk_shape(fp.chunk)));
    for (int64_t r = 0; r < group.shard_size; ++r) {
      outputs[static_cast<size_t>(r)].push_back(
          fp.unsharded.narrow(fp.shard_dim, r * fp.chunk, fp.chunk));
    }
  }
  return all_gather_into_pieces(outputs, inputs, group.shard_group, CollectiveOptions());
}

} // namespace

void all_gather_flat(FSDPParamGroup& group, PendingGather& pending, const Group& over,
                     bool background, bool may_gather_in_place) {
  if (over.size() == 1) {
    // One rank's gather is its input: no collective (as PyTorch's FSDP2), only the copy-out
    // (a cast or an extension's rebuilding; without either the unit aliases and never gets
    // here, [Note: one-rank shard groups alias] in param_group.cpp).
    pending.buffer.emplace(pending.input);
    return;
  }
  if (pending.extension) {
    DTENSOR_CHECK(!group.custom_all_gather.call,
                  "fully_shard unit '{}': a custom all-gather cannot gather parameters with an "
                  "all-gather extension (float8's: convert_to_float8_training's "
                  "enable_fsdp_float8_all_gather)",
                  group.name);
    pending.buffer.emplace(at::empty({over.size() * pending.input.numel()},
                                     at::TensorOptions(at::kByte).device(group.device)));
    pending.work = dtensor::all_gather_into_tensor(pending.buffer->tensor, pending.input, over,
                                                   detail::known_sizes(background));
    return;
  }
  if (may_gather_in_place && !background && gathers_in_place(group)) {
    pending.work = gather_in_place(group, pending.input);
    return;
  }
  pending.buffer.emplace(allocate_comm(group, group.shard_size * group.shard_numel,
                                       group.param_dtype, group.custom_all_gather.allocate,
                                       "all-gather"));
  at::Tensor& gathered = pending.buffer->tensor;
  if (group.custom_all_gather.call) {
    group.custom_all_gather.call(gathered, pending.input, over);
  } else {
    pending.work = dtensor::all_gather_into_tensor(gathered, pending.input, over,
                                                   detail::known_sizes(background));
  }
}

void all_gather_copy_out(FSDPParamGroup& group, PendingGather& pending) {
  pending.work.wait();
  if (!pending.buffer) {
    return; // gathered in place
  }
  at::NoGradGuard no_grad;
  allocate_storage(group.unsharded_flat);
  if (pending.extension) {
    extension_copy_out(group, *pending.extension, pending.buffer->tensor);
    return;
  }
  for (const FSDPParam& fp : group.params) {
    fp.copy_out(pending.buffer->tensor, group.shard_numel, group.shard_size);
  }
}

namespace {

at::Tensor reduce_with_hook(FSDPParamGroup& group, at::Tensor& input) {
  const auto& [registered, hook] = *group.comm_hook;
  const CommHookState hook_state = resolved_hook_state(registered, group.shard_group);
  at::Tensor output = at::empty({group.shard_numel}, input.options());
  hook.reduce_scatter(hook_state, input, output);
  DTENSOR_CHECK(output.defined() && output.numel() == group.shard_numel,
                "fully_shard unit '{}': communication hook '{}' must leave a reduced shard of {} "
                "elements in `output`, got {}",
                group.name, hook.name, group.shard_numel, output.defined() ? output.numel() : 0);
  return output.reshape({group.shard_numel});
}

// [Note: communication hooks on HSDP] FSDP1 refuses register_comm_hook for hybrid
// strategies; here a hook serves HSDP units with both its halves: reduce_scatter over the
// shard dim (state: the registered one, its group the shard group unless given) and
// all_reduce over the replicate dim (state: the replicate group and its own divide
// factors). With the built-in hooks each half averages over its dim, so together they
// average over every data-parallel rank, as native HSDP does.
void all_reduce_with_hook(const FSDPParamGroup& group, at::Tensor& output) {
  const auto& [registered, hook] = *group.comm_hook;
  at::Tensor reduced = output;
  hook.all_reduce(resolved_hook_state(CommHookState(), *group.replicate_group), reduced);
  DTENSOR_CHECK(reduced.defined() && reduced.numel() == output.numel(),
                "fully_shard unit '{}': communication hook '{}' must leave the all-reduced shard "
                "of {} elements in its bucket, got {}",
                group.name, hook.name, output.numel(), reduced.defined() ? reduced.numel() : 0);
  output = reduced.reshape({output.numel()});
}

void run_all_reduce_hook(const FSDPParamGroup& group, at::Tensor& output) {
  if (!group.all_reduce_hook) {
    return;
  }
  // [Note: all-reduce hook] FSDP2's place: after the reduce-scatter (and HSDP's
  // all-reduce), before the post-division, the cast back and the copy into the gradients.
  const auto numel = output.numel();
  const auto dtype = output.scalar_type();
  group.all_reduce_hook(output);
  DTENSOR_CHECK(output.defined() && output.numel() == numel && output.scalar_type() == dtype,
                "fully_shard unit '{}': the all-reduce hook must leave the reduced gradient "
                "a {} tensor of {} elements",
                group.name, c10::toString(dtype), numel);
}

// [Note: partial reduce output] FSDP2's set_requires_all_reduce(false), for HSDP gradient
// accumulation that reduce-scatters every microbatch (freeing the unsharded gradients) but
// all-reduces over the replicate dim once: each microbatch's reduced shard (pre-divided,
// not all-reduced, not post-divided) is added into partial_reduce_output and .grad is left
// alone; the first reduce with the all-reduce on adds the partial to its own shard and
// all-reduces the sum. Every step is linear, so the result is the all-reduce of the sum.
// As in FSDP2 the partial outlives optimizer steps and zero_grad: the last microbatch of a
// step must have the all-reduce on.
bool keep_or_merge_partial(FSDPParamGroup& group, PendingReduce& pending) {
  if (group.replicate_group && !group.requires_all_reduce) {
    if (group.partial_reduce_output.defined()) {
      group.partial_reduce_output.add_(pending.output);
      for (size_t i = 0; i < pending.received.size(); ++i) {
        group.partial_received[i] = group.partial_received[i] || pending.received[i];
      }
    } else {
      group.partial_reduce_output = pending.output;
      group.partial_received = pending.received;
    }
    return false;
  }
  if (group.partial_reduce_output.defined()) {
    pending.output.add_(group.partial_reduce_output);
    for (size_t i = 0; i < pending.received.size(); ++i) {
      pending.received[i] = pending.received[i] || group.partial_received[i];
    }
    group.partial_reduce_output = at::Tensor();
    group.partial_received.clear();
  }
  return true;
}

} // namespace

void reduce_scatter_flat(FSDPParamGroup& group, PendingReduce& pending) {
  at::Tensor& input = pending.input->tensor;
  if (group.comm_hook) {
    pending.output = reduce_with_hook(group, input);
    return;
  }
  const DivideFactors f =
      gradient_divide_factors(group.mesh.size(), group.reduce_dtype, group.gradient_divide_factor,
                              group.force_sum_reduction);
  pending.factors = f;
  if (f.premul != 1) {
    input.mul_(f.premul); // NCCL's PreMulSum, emulated: multiply, then SUM
  }
  if (f.pre != 1) {
    input.div_(f.pre);
  }
  if (group.shard_group.size() == 1) {
    // One rank's reduce-scatter is its input, already divided ([Note: one-rank shard groups
    // alias] in param_group.cpp): no collective, no output buffer (PyTorch's FSDP2 copies).
    pending.output = input;
    return;
  }
  const CustomReduceScatter& custom = group.custom_reduce_scatter;
  pending.output = allocate_comm(group, group.shard_numel, group.reduce_dtype, custom.allocate,
                                 "reduce-scatter");
  if (custom.call) {
    custom.call(pending.output, input, group.shard_group, f.reduce_scatter_op);
    return;
  }
  pending.work =
      dtensor::reduce_scatter_tensor_into(pending.output, input, f.reduce_scatter_op,
                                          group.shard_group, detail::known_sizes(group.overlap));
  if (reduce_scatter_input_free_at_issue(group.shard_group, f.reduce_scatter_op)) {
    pending.input.reset(); // one unit less in flight at the start of backward
  }
}

bool finish_reduce_scatter(FSDPParamGroup& group, PendingReduce& pending) {
  pending.work.wait();
  if (!keep_or_merge_partial(group, pending)) {
    return false;
  }
  if (group.comm_hook) { // the hook divided; [Note: communication hooks on HSDP]
    if (group.replicate_group) {
      all_reduce_with_hook(group, pending.output);
    }
    run_all_reduce_hook(group, pending.output);
    return true;
  }
  const DivideFactors& f = pending.factors;
  if (group.replicate_group) {
    dtensor::all_reduce_(pending.output, f.all_reduce_op, *group.replicate_group,
                         detail::known_sizes());
  }
  run_all_reduce_hook(group, pending.output);
  if (f.post != 1) {
    pending.output.div_(f.post);
  }
  return true;
}

} // namespace dtensor::detail
