// Ops that mix whole dimensions: windows over the last k dims (pooling, upsampling, padding,
// pixel and channel shuffles, tril / triu, diagonals, batched linear algebra), ops along
// named dims (flip, roll, glu), and ops computed on whole tensors (scatter / index_add families,
// batch norm, histograms, linalg ops with vector operands, ...). Shards on the dims an op does not
// mix stay; the dims it mixes are gathered; Partial inputs are reduced (none of these is linear).
// Only functional overloads are registered: a rule here may redistribute an argument, which
// an op writing that argument cannot take (its write would land in the copy).
#include <algorithm>

#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

void refuse_written_args(const OpInfo& info) {
  for (const auto& a : info.op->schema().arguments()) {
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) {
      fail_unsupported(info, "this rule gathers its inputs, so an overload writing argument '" +
                                 a.name() + "' is not supported; use the functional op");
    }
  }
}

OpSharding replicate_functional(const OpInfo& info) {
  refuse_written_args(info);
  return all_replicate(info);
}

// Dims [keep, ndim) marked whole.
std::vector<bool> dims_from(int64_t ndim, int64_t keep) {
  std::vector<bool> whole(static_cast<size_t>(ndim));
  for (int64_t d = 0; d < ndim; ++d) {
    whole[static_cast<size_t>(d)] = d >= keep;
  }
  return whole;
}

// Every DTensor argument laid out as `want` (they share input 0's leading dims), every
// output too.
OpSharding leading_layout(const OpInfo& info, const Placements& want) {
  OpSharding s;
  s.inputs.resize(info.num_args());
  for (size_t a = 0; a < info.num_args(); ++a) {
    if (info.specs[a]) {
      s.inputs[a] = want;
    }
  }
  s.outputs.assign(info.op->schema().returns().size(), want);
  return s;
}

// Input 0's leading dims [0, keep) can stay sharded when every other DTensor argument has
// the same rank and the same sizes there (they index the same batch); otherwise all whole.
OpSharding leading_dims(const OpInfo& info, int64_t keep) {
  refuse_written_args(info);
  const DTensorSpec& in = *info.specs[0];
  for (size_t a = 1; a < info.num_args(); ++a) {
    if (info.specs[a] == std::nullopt) {
      continue;
    }
    const DTensorSpec& o = *info.specs[a];
    if (o.ndim() != in.ndim() ||
        !std::equal(in.shape.begin(), in.shape.begin() + std::max<int64_t>(keep, 0),
                    o.shape.begin())) {
      return all_replicate(info);
    }
  }
  // Window kernels refuse inputs with an empty dim (pooling, upsampling): a dim that would
  // leave some rank an empty shard is gathered too.
  std::vector<bool> whole = dims_from(in.ndim(), keep);
  for (size_t i = 0; i < in.placements.size(); ++i) {
    const Placement& p = in.placements[i];
    if (p.is_shard() && p.dim() < in.ndim()) {
      const int64_t size = in.shape[static_cast<size_t>(p.dim())];
      const int64_t n = info.mesh->size(static_cast<int64_t>(i));
      const int64_t chunk = (size + n - 1) / n;
      if (chunk * (n - 1) >= size) {
        whole[static_cast<size_t>(p.dim())] = true;
      }
    }
  }
  OpSharding s = leading_layout(info, keep_other_shards(in, whole));
  s.leading_dims_from_input = std::max<int64_t>(keep, 0);
  return s;
}

// The last k dims mixed (k per op family).
template <int K>
OpSharding last_dims(const OpInfo& info) {
  return leading_dims(info, info.specs[0]->ndim() - K);
}

// channel_shuffle(self, groups): mixes dim 1 (channels) and keeps the rest in place.
OpSharding channel_shuffle_rule(const OpInfo& info) {
  OpSharding s = leading_dims(info, 1);
  s.output_shapes.assign(1, info.specs[0]->shape); // no meta kernel; the shape is kept
  return s;
}

// constant_pad_nd(self, pad, value): pads the last pad.size() / 2 dims.
OpSharding constant_pad_rule(const OpInfo& info) {
  const auto padded = static_cast<int64_t>(info.arg(1).toIntVector().size() / 2);
  return leading_dims(info, info.specs[0]->ndim() - padded);
}

// diagonal(self, offset, dim1, dim2), a view: the other dims keep their shards (moved to
// their output positions), the diagonal's two dims are gathered; a Partial passes (the
// diagonal is a selection, linear).
OpSharding diagonal_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  const int64_t d1 = wrap_dim(info.arg(2).toInt(), in.ndim());
  const int64_t d2 = wrap_dim(info.arg(3).toInt(), in.ndim());
  Placements want = in.placements;
  Placements out = in.placements;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!want[i].is_shard()) {
      continue;
    }
    const int64_t d = want[i].dim();
    if (d == d1 || d == d2) {
      want[i] = out[i] = Placement::replicate();
    } else {
      out[i] = Placement::shard(d - (d > d1 ? 1 : 0) - (d > d2 ? 1 : 0));
    }
  }
  return single_input(info, want, out, 1);
}

// diag_embed(self, offset, dim1, dim2): with the new dims last (the default), the input's
// leading dims keep their positions and shards; otherwise everything whole.
OpSharding diag_embed_rule(const OpInfo& info) {
  const int64_t in_ndim = info.specs[0]->ndim();
  const int64_t d1 = wrap_dim(info.arg(2).toInt(), in_ndim + 1);
  const int64_t d2 = wrap_dim(info.arg(3).toInt(), in_ndim + 1);
  if (std::min(d1, d2) < in_ndim - 1) {
    return replicate_functional(info);
  }
  return leading_dims(info, in_ndim - 1);
}

// flip(self, dims), roll(self, shifts, dims), rot90(self, k, dims), glu(self, dim),
// logcumsumexp(self, dim): the named dims whole (roll without dims flattens: everything
// whole), other shards stay where they are.
OpSharding named_dims_whole(const OpInfo& info) {
  refuse_written_args(info);
  const DTensorSpec& in = *info.specs[0];
  std::vector<bool> whole(static_cast<size_t>(in.ndim()), false);
  const auto& args = info.op->schema().arguments();
  bool named = false;
  for (size_t a = 0; a < args.size() && a < info.num_args(); ++a) {
    if (args[a].name() != "dim" && args[a].name() != "dims") {
      continue;
    }
    const c10::IValue& v = info.arg(a);
    std::vector<int64_t> dims = v.isInt()
                                    ? std::vector<int64_t>{v.toInt()}
                                    : (v.isIntList() ? v.toIntVector() : std::vector<int64_t>{});
    for (int64_t d : dims) {
      whole[static_cast<size_t>(wrap_dim(d, in.ndim()))] = true;
      named = true;
    }
  }
  if (!named) {
    std::fill(whole.begin(), whole.end(), true);
  }
  const Placements want = keep_other_shards(in, whole);
  OpSharding s = single_input(info, want, want, info.op->schema().returns().size());
  const std::string_view n = info.name;
  if (n.rfind("aten::roll", 0) == 0 || n.rfind("aten::flip", 0) == 0 ||
      n.rfind("aten::logcumsumexp", 0) == 0) {
    s.output_shapes.assign(s.outputs.size(), in.shape); // no meta kernels; the shape is kept
  } else if (n.rfind("aten::rot90", 0) == 0) {
    std::vector<int64_t> shape = in.shape; // no meta kernel (it flips): odd turns swap dims
    const auto dims = info.arg(2).toIntVector();
    if (((info.arg(1).toInt() % 4) + 4) % 2 == 1 && dims.size() == 2) {
      std::swap(shape[static_cast<size_t>(wrap_dim(dims[0], in.ndim()))],
                shape[static_cast<size_t>(wrap_dim(dims[1], in.ndim()))]);
    }
    s.output_shapes.assign(1, shape);
  }
  return s;
}

} // namespace

void register_whole_ops() {
  for (const char* name :
       {"aten::max_pool2d_with_indices", "aten::max_pool2d_with_indices_backward",
        "aten::avg_pool2d", "aten::avg_pool2d_backward", "aten::_adaptive_avg_pool2d",
        "aten::_adaptive_avg_pool2d_backward", "aten::adaptive_max_pool2d", "aten::max_unpool2d",
        "aten::fractional_max_pool2d", "aten::upsample_nearest2d",
        "aten::_upsample_nearest_exact2d", "aten::upsample_bilinear2d",
        "aten::_upsample_bilinear2d_aa", "aten::upsample_bicubic2d", "aten::tril", "aten::triu",
        // batched linear algebra on the last two dims
        "aten::_linalg_det", "aten::_linalg_slogdet", "aten::_linalg_eigh", "aten::_linalg_svd",
        "aten::_linalg_solve_ex", "aten::linalg_inv_ex", "aten::linalg_cholesky_ex",
        "aten::linalg_lu", "aten::linalg_lu_factor_ex", "aten::linalg_ldl_factor_ex",
        "aten::linalg_qr", "aten::linalg_matrix_exp", "aten::linalg_solve_triangular",
        "aten::triangular_solve", "aten::cholesky_solve", "aten::cholesky_inverse", "aten::geqrf",
        "aten::linalg_pinv.atol_rtol_tensor"}) {
    register_rule(name, last_dims<2>);
  }
  for (const char* name :
       {"aten::max_pool3d_with_indices", "aten::_adaptive_avg_pool3d", "aten::adaptive_max_pool3d",
        "aten::pixel_shuffle", "aten::pixel_unshuffle", "aten::upsample_nearest3d",
        "aten::upsample_trilinear3d", "aten::im2col"}) {
    register_rule(name, last_dims<3>);
  }
  for (const char* name :
       {"aten::upsample_nearest1d", "aten::_upsample_nearest_exact1d", "aten::upsample_linear1d"}) {
    register_rule(name, last_dims<1>);
  }
  for (const char* name : {"aten::reflection_pad1d", "aten::replication_pad1d"}) {
    register_rule(name, last_dims<1>);
  }
  for (const char* name : {"aten::reflection_pad2d", "aten::replication_pad2d"}) {
    register_rule(name, last_dims<2>);
  }
  for (const char* name : {"aten::reflection_pad3d", "aten::replication_pad3d"}) {
    register_rule(name, last_dims<3>);
  }
  register_rule("aten::constant_pad_nd", constant_pad_rule);
  register_rule("aten::channel_shuffle", channel_shuffle_rule);
  register_rule("aten::diagonal", diagonal_rule);
  register_rule("aten::diag_embed", diag_embed_rule);
  for (const char* name :
       {"aten::flip", "aten::roll", "aten::rot90", "aten::glu", "aten::logcumsumexp"}) {
    register_rule(name, named_dims_whole);
  }
  // Computed on whole tensors (PyTorch's replicate strategy for these).
  for (const char* name : {"aten::scatter.src",
                           "aten::scatter.value",
                           "aten::scatter.reduce",
                           "aten::scatter.value_reduce",
                           "aten::scatter_add",
                           "aten::scatter_reduce.two",
                           "aten::index_add",
                           "aten::index_copy",
                           "aten::index_reduce",
                           "aten::index_fill.int_Scalar",
                           "aten::index_fill.int_Tensor",
                           "aten::masked_scatter",
                           "aten::put",
                           "aten::take",
                           "aten::histc",
                           "aten::bucketize.Tensor",
                           "aten::isin.Tensor_Tensor",
                           "aten::trace",
                           "aten::vdot",
                           "aten::addmv",
                           "aten::addr",
                           "aten::nansum",
                           "aten::count_nonzero",
                           "aten::count_nonzero.dim_IntList",
                           "aten::aminmax",
                           "aten::nanmedian",
                           "aten::nanmedian.dim",
                           "aten::kthvalue",
                           "aten::native_batch_norm",
                           "aten::_native_batch_norm_legit.no_stats",
                           "aten::native_group_norm",
                           "aten::_prelu_kernel",
                           "aten::log_sigmoid_forward",
                           "aten::huber_loss",
                           "aten::linalg_cross",
                           "aten::norm.ScalarOpt_dim",
                           "aten::narrow_copy",
                           "aten::grid_sampler_2d",
                           "aten::linalg_householder_product",
                           "aten::ormqr",
                           "aten::lu_unpack",
                           "aten::linalg_lu_solve",
                           "aten::linalg_ldl_solve",
                           "aten::_euclidean_dist",
                           "aten::_cdist_forward",
                           "aten::_pdist_forward",
                           "aten::searchsorted.Tensor",
                           "aten::unique_consecutive",
                           "aten::unique_dim",
                           "aten::_unique2",
                           "aten::nonzero",
                           "aten::masked_select",
                           "aten::segment_reduce",
                           "aten::binary_cross_entropy",
                           "aten::binary_cross_entropy_with_logits",
                           "aten::smooth_l1_loss",
                           "aten::soft_margin_loss",
                           "aten::multi_margin_loss",
                           "aten::multilabel_margin_loss_forward",
                           "aten::diagonal_scatter",
                           "aten::select_scatter",
                           "aten::addbmm",
                           "aten::histogram",
                           "aten::_histogramdd_bin_edges",
                           "aten::_histogramdd_from_bin_cts",
                           "aten::_histogramdd_from_bin_tensors",
                           "aten::repeat_interleave.Tensor",
                           "aten::nonzero_static",
                           "aten::searchsorted.Scalar",
                           "aten::_trilinear",
                           "aten::block_diag",
                           "aten::linalg_matrix_sqrth",
                           "aten::linalg_polar",
                           "aten::linalg_lstsq",
                           "aten::_embedding_bag_forward_only",
                           "aten::index.Tensor",
                           "aten::index_put",
                           "aten::_unsafe_masked_index",
                           "aten::_unsafe_masked_index_put_accumulate",
                           "aten::_index_put_impl"}) {
    register_rule(name, replicate_functional);
  }
}

} // namespace dtensor::detail
