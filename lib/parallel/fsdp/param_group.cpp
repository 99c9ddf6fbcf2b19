// A fully_shard unit's parameters and buffers (fsdp_param_group.h): the flat shard, the
// unsharded buffer, unsharding into it and freeing it.
#include <algorithm>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp> // dtensor::Work held in pending collectives

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "parallel/fsdp/all_gather_extension.h"
#include "parallel/fsdp/fsdp_collectives.h"
#include "parallel/fsdp/fsdp_state.h"
#include "parallel/tp/tensor_parallel.h"

namespace dtensor::detail {

namespace {

// [Note: the gradient accumulator of a managed parameter]
// Autograd sends a leaf's gradient to the node impl::grad_accumulator(leaf) returns, which
// is normally an AccumulateGrad writing .grad. A managed parameter gets this node instead:
// its gradient arrives unsharded (the ops ran on the unsharded values) and is kept by the
// unit until every gradient of the unit is in, then reduce-scattered once; .grad becomes
// (or accumulates into) a Shard DTensor. Its input metadata is the unsharded parameter's
// (param_dtype), so the engine does not cast low-precision gradients up on the way.
struct FSDPAccumulateGrad : torch::autograd::Node {
  FSDPAccumulateGrad(std::weak_ptr<FSDPParamGroup> group, size_t index, const at::Tensor& unsharded)
      : Node(/*sequence_nr=*/UINT64_MAX), group_(std::move(group)), index_(index) {
    compat::add_input_metadata(*this, unsharded.options(), unsharded.sym_sizes());
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (auto g = group_.lock(); g && !grads.empty() && grads[0].defined()) {
      g->on_grad(index_, grads[0]);
    }
    return {};
  }
  std::string name() const override { return "dtensor::FSDPAccumulateGrad"; }

 private:
  std::weak_ptr<FSDPParamGroup> group_;
  size_t index_;
};

} // namespace

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  fsdp_memory().unsharded -= static_cast<int64_t>(s->nbytes());
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

void allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t need = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() < need) {
    fsdp_memory().unsharded += static_cast<int64_t>(need - s->nbytes());
    s->set_data_ptr_noswap(s->allocator()->allocate(need));
    s->set_nbytes(need);
    fsdp_memory().note_peak();
  }
}

namespace {

// A tensor of `numel` elements whose storage is not allocated yet (allocate_storage fills
// it in when the unit is first unsharded): no rank holds a whole unit before it is used.
at::Tensor unallocated(int64_t numel, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return t;
}

// A contiguous view of `shape` at element `offset` of `flat`'s storage, made without the
// bounds check of view(): the storage may hold no memory yet.
at::Tensor view_into(const at::Tensor& flat, int64_t offset, c10::IntArrayRef shape) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(flat.storage()),
                                                          flat.key_set(), flat.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  t.unsafeGetTensorImpl()->set_storage_offset(offset);
  return t;
}

} // namespace

FsdpMemory& fsdp_memory() {
  static FsdpMemory memory;
  return memory;
}

void FsdpMemory::note_peak() {
  const int64_t now = unsharded.load() + comm.load();
  int64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

CommBuffer::CommBuffer(at::Tensor t)
    : tensor(std::move(t)), bytes(static_cast<int64_t>(tensor.nbytes())) {
  fsdp_memory().comm += bytes;
  fsdp_memory().note_peak();
}

CommBuffer::~CommBuffer() {
  fsdp_memory().comm -= bytes;
}

std::shared_ptr<FSDPParamGroup> FSDPParamGroup::shared() const {
  return {owner_->shared_from_this(), const_cast<FSDPParamGroup*>(this)};
}

// [Note: one-rank shard groups alias]
// Over a shard group of one rank the flat shard is every parameter whole, laid out as the
// unsharded buffer is (no padding: each parameter's chunk is all of its rows). When the
// forward's dtype is the stored one (no mixed precision, no all-gather extension) and the shard
// lives on the device (no offload), the unsharded buffer is the flat shard itself: unshard
// and reshard move and free nothing, no all-gather is issued, and the parameters hold no
// second copy. The gradients skip their reduce-scatter too (reduce_scatter_flat): the
// reduced shard is the flat gradient (HSDP's all-reduce over the replicate dim still runs).
// PyTorch 2.15's FSDP2 skips both collectives there as well but keeps two copies (it copies
// the shard into an unsharded buffer and the gradient into an output); docs/conformance.md.
bool FSDPParamGroup::aliases_shard() const {
  if (shard_size != 1 || param_dtype != orig_dtype || options.offload_policy().offload_to_cpu()) {
    return false;
  }
  return !has_all_gather_extension(*this);
}

// The flat shard (zeros: padding stays zero) and the unsharded buffer, unallocated, with
// each parameter's view of it. On the meta device (a module built there) neither holds
// memory until to_empty.
void FSDPParamGroup::allocate_buffers() {
  const bool offload = options.offload_policy().offload_to_cpu() && !device.is_meta();
  const c10::Device shard_device = offload ? c10::Device(c10::kCPU) : device;
  // [Note: pinned offload] OffloadPolicy::pin_memory: the offloaded flat shard (and so
  // every sharded parameter, a view of it) lives in page-locked memory, which the
  // accelerator copies from asynchronously (fully_shard checked that there is one).
  const bool pinned = offload && options.offload_policy().pin_memory();
  flat_shard =
      at::zeros({shard_numel},
                at::TensorOptions().dtype(orig_dtype).device(shard_device).pinned_memory(pinned));
  // A parameter kept as gathered has no place in the unsharded buffer: its `unsharded` is a
  // shape and dtype over a storage never allocated.
  int64_t total = 0;
  for (const FSDPParam& fp : params) {
    total += fp.keeps_gathered ? 0 : c10::multiply_integers(fp.shape);
  }
  aliased = aliases_shard();
  const auto as_param = at::TensorOptions().dtype(param_dtype).device(device);
  unsharded_flat = aliased ? view_into(flat_shard, 0, {total}) : unallocated(total, as_param);
  const at::Tensor nowhere = unallocated(0, as_param);
  int64_t unsharded_offset = 0;
  for (FSDPParam& fp : params) {
    if (fp.keeps_gathered) {
      fp.unsharded = view_into(nowhere, 0, fp.shape);
      continue;
    }
    fp.unsharded = view_into(unsharded_flat, unsharded_offset, fp.shape);
    unsharded_offset += c10::multiply_integers(fp.shape);
  }
}

// Turns each parameter, in place, into its Shard DTensor over its piece of the flat shard,
// with the unit's gradient accumulator.
void FSDPParamGroup::bind_params() {
  const std::weak_ptr<FSDPParamGroup> weak = shared();
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam& fp = params[i];
    auto tag = std::make_shared<FsdpTag>();
    tag->group = weak;
    tag->index = i;
    fp.to_sharded(flat_shard, std::move(tag));
    if (fp.param.requires_grad() && !device.is_meta()) {
      fp.grad_node = compat::make_node<FSDPAccumulateGrad>(weak, i, fp.unsharded_value());
      compat::set_grad_accumulator(fp.param, fp.grad_node);
    }
  }
}

// Fills the flat shard from the parameters' full values (none on the meta device) and
// converts the parameters.
void FSDPParamGroup::materialize(const std::vector<at::Tensor>& values) {
  at::NoGradGuard no_grad;
  allocate_buffers();
  for (size_t i = 0; i < params.size() && !device.is_meta(); ++i) {
    const FSDPParam& fp = params[i];
    const int64_t start =
        chunk_offset(fp.shape[static_cast<size_t>(fp.shard_dim)], shard_size, shard_rank);
    if (fp.local_rows > 0) {
      fp.local_rows_of(flat_shard).copy_(values[i].narrow(fp.shard_dim, start, fp.local_rows));
    }
  }
  bind_params();
}

void FSDPParamGroup::to_empty(c10::Device target) {
  DTENSOR_CHECK(device.is_meta(),
                "to_empty: fully_shard unit '{}' is already on {}; only a unit built from meta "
                "parameters is materialized",
                name, device.str());
  device = target;
  allocate_buffers();
  bind_params();
}

void FSDPParamGroup::init_sharded(std::vector<std::pair<std::string, at::Tensor>> named_params) {
  const bool hsdp = mesh.ndim() == 2;
  shard_group = mesh.get_group(hsdp ? 1 : 0);
  if (hsdp) {
    replicate_group = mesh.get_group(0);
  }
  shard_size = mesh.size(hsdp ? 1 : 0);
  shard_rank = mesh.get_local_rank(hsdp ? 1 : 0);

  // [Note: FSDP x TP] A tensor-parallel parameter (a DTensor with placement T on a 1-D tp
  // mesh) is sharded by its local tensor's rows: rank (t, d) keeps chunk_d(chunk_t(W)). On
  // the (tp, dp) mesh -- tp first -- DTensor's nested Shard semantics give exactly that
  // piece for placements (T, Shard(0)), even when T is Shard(0) too and sizes are uneven,
  // so full_tensor(), redistribution and state dicts need no strided-shard placement.
  // HSDP x TP is the same on the (tp, dp_replicate, dp_shard) mesh with (T, Replicate,
  // Shard(0)). PyTorch orders the mesh (dp..., tp) and writes the dp shard as
  // _StridedShard; the pieces are the same.
  int64_t offset = 0;
  std::vector<at::Tensor> values; // what each parameter's shard is cut from
  auto shard_placement = [this](const at::Tensor& p) {
    std::optional<Placement> chosen;
    if (options.shard_placement_fn()) {
      chosen = options.shard_placement_fn()(p);
    }
    return chosen.value_or(Placement::shard(0)).normalized(p.dim());
  };
  for (auto& [fqn, p] : named_params) {
    const auto& [first_fqn, first] = named_params.front();
    const DTensorMeta* tp_meta = dtensor_meta(p);
    values.push_back(tp_meta ? tp_meta->local : p.detach());
    DTENSOR_CHECK(p.scalar_type() == first.scalar_type(),
                  "fully_shard({}): parameters of one unit must share a dtype: '{}' is {}, '{}' "
                  "is {}",
                  name, fqn, c10::toString(p.scalar_type()), first_fqn,
                  c10::toString(first.scalar_type()));
    params.emplace_back(fqn, p, values.back(), offset, shard_placement(p), shard_info(), name);
    params.back().extension = take_all_gather_extension(p);
    DTENSOR_CHECK(!params.back().extension || !tp_meta || tp_meta->spec.mesh.size() == 1,
                  "fully_shard({}): '{}' has an all-gather extension ('{}'), which tensor "
                  "parallelism over more than one rank does not support yet",
                  name, fqn, params.back().extension ? params.back().extension->name() : "");
    offset += params.back().segment_numel();
  }
  shard_numel = offset;
  if (params.empty()) {
    return;
  }
  // An int reshard_after_forward keeps unsharded values in param_dtype after forward: its
  // units rebuild with post_all_gather ([Note: the all-gather extension]).
  const auto& raf = options.reshard_after_forward();
  const bool to_smaller_group =
      raf && raf->is_group_size() && raf->group_size() > 1 && raf->group_size() < shard_size;
  for (FSDPParam& fp : params) {
    fp.keeps_gathered = fp.extension && fp.extension->keeps_gathered() && !to_smaller_group;
  }
  orig_dtype = params.front().param.scalar_type();
  const auto& mp = options.mp_policy();
  param_dtype = mp.param_dtype().value_or(orig_dtype);
  reduce_dtype = mp.reduce_dtype().value_or(param_dtype);
  materialize(values);
}

void FSDPParamGroup::unshard(bool async, bool explicit_background) {
  if (state == ShardState::Unsharding) {
    if (!async) {
      finish_unshard();
    }
    return;
  }
  if (state == ShardState::Unsharded) {
    return;
  }
  if (params.empty() || aliased) { // [Note: one-rank shard groups alias]
    state = ShardState::Unsharded;
    return;
  }
  at::NoGradGuard no_grad;
  // From the piece kept after forward, over its k ranks ([Note: reshard to a smaller
  // group] in post_forward.cpp), or from the flat shard over the shard group.
  const bool post_forward = state == ShardState::ShardedPostForward;
  // The piece kept after forward holds unsharded (rebuilt) values: gathered as they are.
  std::shared_ptr<ExtensionGather> extension;
  at::Tensor input;
  if (post_forward) {
    input = take_post_forward_piece();
  } else if (has_all_gather_extension(*this)) {
    extension = std::make_shared<ExtensionGather>();
    input = extension_all_gather_input(*this, *extension);
  } else {
    input = flat_shard.to(device, param_dtype);
  }
  auto pending = std::make_shared<PendingGather>(std::move(input));
  pending->extension = std::move(extension);
  const bool background = async && (overlap || explicit_background);
  all_gather_flat(*this, *pending, post_forward ? post_forward_group : shard_group, background,
                  /*may_gather_in_place=*/!post_forward);
  gather = std::move(pending);
  state = ShardState::Unsharding;
  if (!async) {
    finish_unshard();
  }
}

void FSDPParamGroup::finish_unshard() {
  if (state != ShardState::Unsharding) {
    return;
  }
  std::shared_ptr<PendingGather> pending = std::move(gather);
  state = ShardState::Sharded; // until the copy-out is done (a failed wait leaves it so)
  all_gather_copy_out(*this, *pending);
  state = ShardState::Unsharded;
}

void FSDPParamGroup::reshard() {
  forward_used = false;
  drop_post_forward_piece();
  if (state == ShardState::ShardedPostForward) {
    state = ShardState::Sharded;
    return;
  }
  if (state == ShardState::Unsharding) {
    std::shared_ptr<PendingGather> pending = std::move(gather);
    state = ShardState::Sharded;
    pending->work.wait(); // the buffers may go only once the all-gather is done
    if (!pending->buffer && unsharded_flat.defined()) {
      free_storage(unsharded_flat); // it was being gathered in place
    }
    return;
  }
  if (state == ShardState::Sharded) {
    return;
  }
  state = ShardState::Sharded;
  if (unsharded_flat.defined() && !aliased) {
    free_storage(unsharded_flat);
  }
  free_kept(*this);
}

int64_t FSDPParamGroup::unsharded_storage_bytes() const {
  if (!unsharded_flat.defined() || aliased) {
    return 0; // an aliased buffer is the flat shard's memory
  }
  int64_t bytes = static_cast<int64_t>(unsharded_flat.storage().nbytes());
  for (const FSDPParam& fp : params) {
    for (const at::Tensor& k : fp.kept) {
      bytes += static_cast<int64_t>(k.storage().nbytes());
    }
  }
  return bytes;
}

at::Tensor FSDPParamGroup::unsharded_value(size_t index) const {
  const FSDPParam& fp = params.at(index);
  return fp.keeps_gathered ? fp.unsharded_value_of(kept_unsharded_value(*this, fp))
                           : fp.unsharded_value();
}

} // namespace dtensor::detail

namespace dtensor {

FSDPMemoryStats fsdp_memory_stats() {
  FSDPMemoryStats s;
  const detail::FsdpMemory& m = detail::fsdp_memory();
  s.unsharded_bytes = m.unsharded.load();
  s.communication_bytes = m.comm.load();
  s.peak_bytes = m.peak.load();
  return s;
}

void reset_fsdp_peak_memory() {
  detail::FsdpMemory& m = detail::fsdp_memory();
  m.peak = m.unsharded.load() + m.comm.load();
}

} // namespace dtensor
