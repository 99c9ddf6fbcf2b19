// One managed parameter's sharded <-> unsharded arithmetic (fsdp_param.h).
#include "parallel/fsdp/fsdp_param.h"

#include <algorithm>

#include <ATen/ATen.h>

#include <dtensor/dtensor.h>

#include "internal/check.h"
#include "tensor/dtensor_impl.h"
#include "tensor/placement_helpers.h"
#include "tensor/redistribute/redistribute.h"

namespace dtensor::detail {

FSDPParam::FSDPParam(std::string name, const at::Tensor& p, const at::Tensor& value,
                     int64_t segment_offset, const Placement& shard, const FSDPShardInfo& info,
                     const std::string& unit)
    : param(p), fqn(std::move(name)), shape(value.sizes().vec()), offset(segment_offset) {
  if (const DTensorMeta* tp_meta = dtensor_meta(p)) {
    tp_spec = tp_meta->spec;
    tp_tag = detail::tp_tag(p);
  }
  DTENSOR_CHECK(p.dim() > 0,
                "fully_shard({}): parameter '{}' is a scalar (0-dim) and cannot be "
                "sharded; pass it in ignored_params",
                unit, fqn);
  DTENSOR_CHECK(shard.is_shard() && shard.dim() >= 0 && shard.dim() < p.dim(),
                "fully_shard({}): shard_placement_fn gave {} for parameter '{}' of shape {}; "
                "expected Shard(d) with 0 <= d < {}",
                unit, shard.to_string(), fqn, shape, p.dim());
  shard_dim = shard.dim();
  const int64_t dim_size = shape[static_cast<size_t>(shard_dim)];
  DTENSOR_CHECK(shard_dim == 0 || dim_size % info.size == 0,
                "fully_shard({}): parameter '{}' of shape {} would be sharded unevenly on dim {} "
                "({} rows over {} ranks); only dim 0 may be uneven",
                unit, fqn, shape, shard_dim, dim_size, info.size);
  chunk = chunk_size(dim_size, info.size, 0);
  row_numel = dim_size == 0 ? 0 : value.numel() / dim_size;
  local_rows = rows_on(info.rank, info.size);
  set_sharded_spec(shard, info.mesh, unit);
}

int64_t FSDPParam::rows_on(int64_t shard_rank, int64_t shard_size) const {
  return chunk_size(shape[static_cast<size_t>(shard_dim)], shard_size, shard_rank);
}

std::vector<int64_t> FSDPParam::chunk_shape(int64_t rows) const {
  std::vector<int64_t> s = shape;
  s[static_cast<size_t>(shard_dim)] = rows;
  return s;
}

at::Tensor FSDPParam::local_rows_of(const at::Tensor& flat) const {
  return flat.narrow(0, offset, local_rows * row_numel).view(chunk_shape(local_rows));
}

// The sharded placements: Replicate first for HSDP, then `shard`; for FSDP x TP the
// parameter's tp placement before them, on the (tp, dp...) mesh ([Note: FSDP x TP] in
// param_group.cpp).
void FSDPParam::set_sharded_spec(const Placement& shard, const DeviceMesh& mesh,
                                 const std::string& unit) {
  const c10::ScalarType dtype = param.scalar_type();
  Placements placements;
  if (mesh.ndim() == 2) {
    placements.push_back(Placement::replicate());
  }
  placements.push_back(shard);
  if (!tp_spec) {
    spec = make_spec(mesh, placements, shape, dtype);
    return;
  }
  const DeviceMesh& tp = tp_spec->mesh;
  DTENSOR_CHECK(!tp.dim_names().empty() && !mesh.dim_names().empty(),
                "fully_shard({}): FSDP x TP needs named meshes (slices of one "
                "init_device_mesh), got {} and {}",
                unit, mesh.to_string(), tp.to_string());
  const std::vector<std::string>& dp_names = mesh.dim_names();
  DTENSOR_CHECK(tp.root_mesh() == mesh.root_mesh() &&
                    std::find(dp_names.begin(), dp_names.end(), tp.dim_names()[0]) ==
                        dp_names.end(),
                "fully_shard({}): parameter '{}' is a DTensor on {}, which is not another "
                "dimension of the data-parallel mesh {}'s root mesh {}",
                unit, fqn, tp.to_string(), mesh.to_string(), mesh.root_mesh().to_string());
  std::vector<std::string> names{tp.dim_names()[0]};
  names.insert(names.end(), dp_names.begin(), dp_names.end());
  placements.insert(placements.begin(), tp_spec->placements[0]);
  spec = make_spec(mesh.root_mesh()[names], placements, tp_spec->shape, dtype);
}

void FSDPParam::to_sharded(const at::Tensor& flat_shard, std::shared_ptr<FsdpTag> tag) {
  at::NoGradGuard no_grad;
  at::Tensor dt = make_dtensor(local_rows_of(flat_shard), spec);
  set_fsdp_tag(dt, std::move(tag));
  replace_data(param, dt);
}

at::Tensor FSDPParam::unsharded_value_of(const at::Tensor& value) const {
  if (!tp_spec) {
    return value;
  }
  DTensorSpec s = *tp_spec;
  s.dtype = value.scalar_type();
  at::Tensor dt = make_dtensor(value, s);
  set_tp_tag(dt, tp_tag);
  return dt;
}

void FSDPParam::copy_out(const at::Tensor& gathered, int64_t shard_numel,
                         int64_t shard_size) const {
  for (int64_t r = 0; r < shard_size; ++r) {
    const int64_t rows = rows_on(r, shard_size);
    if (rows == 0) {
      continue;
    }
    at::Tensor src =
        gathered.narrow(0, r * shard_numel + offset, rows * row_numel).view(chunk_shape(rows));
    unsharded.narrow(shard_dim, r * chunk, rows).copy_(src);
  }
}

void FSDPParam::copy_grad_in(at::Tensor& input, int64_t shard_numel, int64_t shard_size) const {
  // Only what no gradient covers is zeroed: a parameter without a gradient contributes
  // zeros, so every rank issues the same collective.
  for (int64_t r = 0; r < shard_size; ++r) {
    const int64_t rows = unsharded_grad.defined() ? rows_on(r, shard_size) : 0;
    const int64_t start = r * shard_numel + offset;
    if (rows > 0) {
      input.narrow(0, start, rows * row_numel)
          .view(chunk_shape(rows))
          .copy_(unsharded_grad.narrow(shard_dim, r * chunk, rows));
    }
    if (rows < chunk) {
      input.narrow(0, start + rows * row_numel, (chunk - rows) * row_numel).zero_();
    }
  }
}

void FSDPParam::accumulate_unsharded_grad(const at::Tensor& dgrad, const std::string& unit) {
  at::Tensor grad = dgrad;
  if (const DTensorMeta* m = dtensor_meta(dgrad)) {
    // A tensor-parallel gradient: its local part in the parameter's tp placement (Partial
    // ones, e.g. of Replicate norm weights under sequence parallelism, are reduced here).
    // A parameter without tensor parallelism used with DTensor activations took part as
    // Replicate ([Note: plain units next to tensor parallelism] in fsdp_dispatch.cpp).
    const Placements want = tp_spec ? tp_spec->placements : replicate_all(m->spec.mesh.ndim());
    DTENSOR_CHECK(!tp_spec || m->spec.mesh == tp_spec->mesh,
                  "fully_shard({}): gradient of '{}' is a DTensor on {} but the parameter is "
                  "tensor-parallel on {}",
                  unit, fqn, m->spec.mesh.to_string(), tp_spec ? tp_spec->mesh.to_string() : "");
    grad = m->spec.placements == want ? m->local : redistribute_local(m->local, m->spec, want);
  } else if (tp_spec && dgrad.sizes() == tp_spec->shape) {
    // Whole and plain ([Note: local outputs] in lib/parallel/tp/tp_dispatch.cpp): this
    // rank's piece.
    grad = dtensor_meta(distribute_tensor(dgrad, tp_spec->mesh, tp_spec->placements,
                                          /*src_data_rank=*/std::nullopt))
               ->local;
  }
  if (unsharded_grad.defined()) {
    unsharded_grad = unsharded_grad + grad; // accumulated without sync before
  } else {
    unsharded_grad = grad.detach();
  }
  grad_received = true;
}

void FSDPParam::accumulate_sharded_grad(const at::Tensor& reduced) {
  at::Tensor local = local_rows_of(reduced);
  at::Tensor& g = param.mutable_grad();
  if (g.defined()) {
    const DTensorMeta& m = checked_meta(g, "fully_shard gradient accumulation");
    m.local.add_(local);
    return;
  }
  DTensorSpec s = spec;
  s.dtype = local.scalar_type();
  g = make_dtensor(local, s);
}

} // namespace dtensor::detail
