// A fully_shard unit's data movement: the flat shard, all-gather into the unsharded buffer,
// freeing it, and the reduce-scatter of gradients.
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
#include "parallel/fsdp/fsdp.h"
#include "parallel/fsdp/memory.h"
#include "parallel/tp/tensor_parallel.h"
#include "tensor/ops/sharding.h"

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

// An all-gather in flight: its input is kept alive with the output until it completes
// ([Note: overlap] in schedule.cpp).
struct PendingGather {
  explicit PendingGather(at::Tensor in) : input(std::move(in)) {}
  at::Tensor input;
  std::optional<CommBuffer> buffer; // the gathered shards, to be copied out (not in place)
  Work work;
};

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
bool FSDPParamGroup::gathers_in_place() const {
  if (custom_all_gather.call || shard_group.backend_type() != BackendType::Gloo ||
      at::isComplexType(param_dtype)) {
    return false;
  }
  for (const FSDPParam& fp : params) {
    if (fp.chunk == 0 || fp.chunk * shard_size != fp.shape[static_cast<size_t>(fp.shard_dim)]) {
      return false;
    }
  }
  return true;
}

Work FSDPParamGroup::gather_in_place(const at::Tensor& input, bool async) {
  allocate_storage(unsharded_flat);
  std::vector<at::Tensor> inputs;
  std::vector<std::vector<at::Tensor>> outputs(static_cast<size_t>(shard_size));
  for (const FSDPParam& fp : params) {
    inputs.push_back(input.narrow(0, fp.offset, fp.segment_numel()).view(fp.chunk_shape(fp.chunk)));
    for (int64_t r = 0; r < shard_size; ++r) {
      outputs[static_cast<size_t>(r)].push_back(
          fp.unsharded.narrow(fp.shard_dim, r * fp.chunk, fp.chunk));
    }
  }
  return all_gather_into_pieces(outputs, inputs, shard_group, CollectiveOptions().async_op(async));
}

int64_t FSDPParam::rows_on(int64_t shard_rank, int64_t shard_size) const {
  return chunk_size(shape[static_cast<size_t>(shard_dim)], shard_size, shard_rank);
}

std::vector<int64_t> FSDPParam::chunk_shape(int64_t rows) const {
  std::vector<int64_t> s = shape;
  s[static_cast<size_t>(shard_dim)] = rows;
  return s;
}

FSDPParamGroup& FSDPParamGroup::root() {
  FSDPParamGroup* g = this;
  for (auto p = parent.lock(); p; p = p->parent.lock()) {
    g = p.get();
  }
  return *g;
}

bool FSDPParamGroup::is_ancestor_of(const FSDPParamGroup& other) const {
  for (auto p = other.parent.lock(); p; p = p->parent.lock()) {
    if (p.get() == this) {
      return true;
    }
  }
  return false;
}

// The sharded placements of a parameter: Replicate first for HSDP, then `shard`; for
// FSDP x TP the parameter's tp placement before them, on the (tp, dp...) mesh ([Note:
// FSDP x TP]).
void FSDPParamGroup::set_sharded_spec(FSDPParam& fp, const Placement& shard) const {
  const c10::ScalarType dtype = fp.param.scalar_type();
  Placements placements;
  if (mesh.ndim() == 2) {
    placements.push_back(Placement::replicate());
  }
  placements.push_back(shard);
  if (!fp.tp_spec) {
    fp.spec = make_spec(mesh, placements, fp.shape, dtype);
    return;
  }
  const DeviceMesh& tp = fp.tp_spec->mesh;
  DTENSOR_CHECK(!tp.dim_names().empty() && !mesh.dim_names().empty(),
                "fully_shard({}): FSDP x TP needs named meshes (slices of one "
                "init_device_mesh), got {} and {}",
                name, mesh.to_string(), tp.to_string());
  const std::vector<std::string>& dp_names = mesh.dim_names();
  DTENSOR_CHECK(tp.root_mesh() == mesh.root_mesh() &&
                    std::find(dp_names.begin(), dp_names.end(), tp.dim_names()[0]) ==
                        dp_names.end(),
                "fully_shard({}): parameter '{}' is a DTensor on {}, which is not another "
                "dimension of the data-parallel mesh {}'s root mesh {}",
                name, fp.fqn, tp.to_string(), mesh.to_string(), mesh.root_mesh().to_string());
  std::vector<std::string> names{tp.dim_names()[0]};
  names.insert(names.end(), dp_names.begin(), dp_names.end());
  placements.insert(placements.begin(), fp.tp_spec->placements[0]);
  fp.spec = make_spec(mesh.root_mesh()[names], placements, fp.tp_spec->shape, dtype);
}

// One parameter's place in the flat shard (its segment starts at `offset`); `value` is
// what its shard is cut from; `first` is the unit's first parameter (for the dtype check).
FSDPParam FSDPParamGroup::plan_param(const std::string& fqn, const at::Tensor& p,
                                     const at::Tensor& value, int64_t offset,
                                     const std::pair<std::string, at::Tensor>& first) const {
  FSDPParam fp;
  fp.param = p;
  fp.fqn = fqn;
  fp.shape = value.sizes().vec();
  if (const DTensorMeta* tp_meta = dtensor_meta(p)) {
    fp.tp_spec = tp_meta->spec;
    fp.tp_tag = tp_tag(p);
  }
  DTENSOR_CHECK(p.dim() > 0,
                "fully_shard({}): parameter '{}' is a scalar (0-dim) and cannot be "
                "sharded; pass it in ignored_params",
                name, fqn);
  std::optional<Placement> placement;
  if (options.shard_placement_fn()) {
    placement = options.shard_placement_fn()(p);
  }
  const Placement shard = placement.value_or(Placement::shard(0)).normalized(p.dim());
  DTENSOR_CHECK(shard.is_shard() && shard.dim() >= 0 && shard.dim() < p.dim(),
                "fully_shard({}): shard_placement_fn gave {} for parameter '{}' of shape {}; "
                "expected Shard(d) with 0 <= d < {}",
                name, shard.to_string(), fqn, fp.shape, p.dim());
  fp.shard_dim = shard.dim();
  const int64_t dim_size = fp.shape[static_cast<size_t>(fp.shard_dim)];
  DTENSOR_CHECK(fp.shard_dim == 0 || dim_size % shard_size == 0,
                "fully_shard({}): parameter '{}' of shape {} would be sharded unevenly on dim {} "
                "({} rows over {} ranks); only dim 0 may be uneven",
                name, fqn, fp.shape, fp.shard_dim, dim_size, shard_size);
  DTENSOR_CHECK(
      p.scalar_type() == first.second.scalar_type(),
      "fully_shard({}): parameters of one unit must share a dtype: '{}' is {}, '{}' is {}", name,
      fqn, c10::toString(p.scalar_type()), first.first, c10::toString(first.second.scalar_type()));
  fp.chunk = chunk_size(dim_size, shard_size, 0);
  fp.row_numel = dim_size == 0 ? 0 : value.numel() / dim_size;
  fp.offset = offset;
  fp.local_rows = fp.rows_on(shard_rank, shard_size);
  set_sharded_spec(fp, shard);
  return fp;
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
  int64_t total = 0;
  for (const FSDPParam& fp : params) {
    total += c10::multiply_integers(fp.shape);
  }
  unsharded_flat = unallocated(total, at::TensorOptions().dtype(param_dtype).device(device));
  int64_t unsharded_offset = 0;
  for (FSDPParam& fp : params) {
    const int64_t numel = c10::multiply_integers(fp.shape);
    fp.unsharded = view_into(unsharded_flat, unsharded_offset, fp.shape);
    unsharded_offset += numel;
  }
}

at::Tensor FSDPParamGroup::local_shard(const FSDPParam& fp) const {
  return flat_shard.narrow(0, fp.offset, fp.local_rows * fp.row_numel)
      .view(fp.chunk_shape(fp.local_rows));
}

// Turns each parameter, in place, into its Shard DTensor over its piece of the flat shard,
// with the unit's gradient accumulator.
void FSDPParamGroup::bind_params() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam& fp = params[i];
    at::Tensor dt = make_dtensor(local_shard(fp), fp.spec);
    auto tag = std::make_shared<FsdpTag>();
    tag->group = weak_from_this();
    tag->index = i;
    set_fsdp_tag(dt, std::move(tag));
    replace_data(fp.param, dt);
    if (fp.param.requires_grad() && !device.is_meta()) {
      fp.grad_node = compat::make_node<FSDPAccumulateGrad>(weak_from_this(), i, unsharded_value(i));
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
      local_shard(fp).copy_(values[i].narrow(fp.shard_dim, start, fp.local_rows));
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
  for (auto& [fqn, p] : named_params) {
    const DTensorMeta* tp_meta = dtensor_meta(p);
    values.push_back(tp_meta ? tp_meta->local : p.detach());
    params.push_back(plan_param(fqn, p, values.back(), offset, named_params.front()));
    offset += params.back().segment_numel();
  }
  shard_numel = offset;
  if (params.empty()) {
    return;
  }
  orig_dtype = params.front().param.scalar_type();
  const auto& mp = options.mp_policy();
  param_dtype = mp.param_dtype().value_or(orig_dtype);
  reduce_dtype = mp.reduce_dtype().value_or(param_dtype);
  materialize(values);
}

at::Tensor FSDPParamGroup::allocate_comm(int64_t numel, c10::ScalarType dtype,
                                         const CommAllocator& allocate, const char* what) const {
  if (!allocate) {
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  }
  at::Tensor t = allocate({numel}, dtype, device);
  DTENSOR_CHECK(t.defined() && t.numel() == numel && t.scalar_type() == dtype &&
                    t.device() == device,
                "fully_shard unit '{}': the custom {}'s allocate must give a {} tensor of {} "
                "elements on {}",
                name, what, c10::toString(dtype), numel, device.str());
  return t.view({numel});
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
  if (params.empty()) {
    state = ShardState::Unsharded;
    return;
  }
  at::NoGradGuard no_grad;
  // From the piece kept after forward, over its k ranks ([Note: reshard to a smaller
  // group] in post_forward.cpp), or from the flat shard over the shard group.
  const bool post_forward = state == ShardState::ShardedPostForward;
  auto pending = std::make_shared<PendingGather>(post_forward ? take_post_forward_piece()
                                                              : flat_shard.to(device, param_dtype));
  const Group& group = post_forward ? post_forward_group : shard_group;
  const bool background = async && (overlap || explicit_background);
  if (!post_forward && !background && gathers_in_place()) {
    pending->work = gather_in_place(pending->input, background);
  } else {
    pending->buffer.emplace(allocate_comm(shard_size * shard_numel, param_dtype,
                                          custom_all_gather.allocate, "all-gather"));
    at::Tensor& gathered = pending->buffer->tensor;
    if (custom_all_gather.call) {
      custom_all_gather.call(gathered, pending->input, group);
    } else {
      pending->work = detail::all_gather_into_tensor(gathered, pending->input, group,
                                             CollectiveOptions().async_op(background));
    }
  }
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
  pending->work.wait();
  if (!pending->buffer) {
    state = ShardState::Unsharded; // gathered in place
    return;
  }
  at::NoGradGuard no_grad;
  allocate_storage(unsharded_flat);
  const at::Tensor& gathered = pending->buffer->tensor;
  for (const FSDPParam& fp : params) {
    for (int64_t r = 0; r < shard_size; ++r) {
      const int64_t rows = fp.rows_on(r, shard_size);
      if (rows == 0) {
        continue;
      }
      at::Tensor src = gathered.narrow(0, r * shard_numel + fp.offset, rows * fp.row_numel)
                           .view(fp.chunk_shape(rows));
      fp.unsharded.narrow(fp.shard_dim, r * fp.chunk, rows).copy_(src);
    }
  }
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
  if (unsharded_flat.defined()) {
    free_storage(unsharded_flat);
  }
}

int64_t FSDPParamGroup::unsharded_storage_bytes() const {
  return unsharded_flat.defined() ? static_cast<int64_t>(unsharded_flat.storage().nbytes()) : 0;
}

at::Tensor FSDPParamGroup::unsharded_value(size_t index) const {
  const FSDPParam& fp = params.at(index);
  if (!fp.tp_spec) {
    return fp.unsharded;
  }
  DTensorSpec spec = *fp.tp_spec;
  spec.dtype = fp.unsharded.scalar_type();
  at::Tensor dt = make_dtensor(fp.unsharded, spec);
  set_tp_tag(dt, fp.tp_tag);
  return dt;
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
