// Neural-network ops: softmax / log_softmax, layer norm, embedding, nll_loss (what
// cross_entropy decomposes to), and their backward kernels.
#include "internal/check.h"
#include "tensor/ops/sharding.h"

namespace dtensor::detail {

namespace {

// `p` with shards of any dim in [from, ndim) and Partial placements replaced by Replicate.
Placements replicate_dims_from(const Placements& p, int64_t from) {
  Placements out;
  for (const auto& x : p) {
    bool cut = x.is_partial() || (x.is_shard() && x.dim() >= from);
    out.push_back(cut ? Placement::replicate() : x);
  }
  return out;
}

Placements replicate_dim(const Placements& p, int64_t dim) {
  Placements out;
  for (const auto& x : p) {
    bool cut = x.is_partial() || x.is_shard(dim);
    out.push_back(cut ? Placement::replicate() : x);
  }
  return out;
}

// _softmax(self, dim, half_to_float) / _log_softmax: the softmax dim must be whole.
OpSharding softmax_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  Placements p = replicate_dim(in.placements, wrap_dim(info.arg(1).toInt(), in.ndim()));
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = p;
  s.outputs.push_back(p);
  s.output_shapes.push_back(in.shape);
  return s;
}

// _softmax_backward_data(grad_output, output, dim, input_dtype)
OpSharding softmax_backward_rule(const OpInfo& info) {
  const DTensorSpec& g = *info.specs[0];
  Placements p = replicate_dim(g.placements, wrap_dim(info.arg(2).toInt(), g.ndim()));
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = p;
  s.inputs[1] = p;
  s.outputs.push_back(p);
  s.output_shapes.push_back(g.shape);
  return s;
}

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
OpSharding layer_norm_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  int64_t axis = in.ndim() - static_cast<int64_t>(info.arg(1).toIntVector().size());
  Placements p = replicate_dims_from(in.placements, axis);
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = p;
  for (size_t a : {size_t{2}, size_t{3}}) {
    if (a < info.num_args() && info.specs[a]) {
      s.inputs[a] = replicate_all(info.mesh_ndim());
    }
  }
  s.outputs = {p, p, p};
  std::vector<int64_t> stats = in.shape;
  for (auto d = static_cast<size_t>(axis); d < stats.size(); ++d) {
    stats[d] = 1;
  }
  s.output_shapes = {in.shape, stats, stats};
  return s;
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?, bias?,
// output_mask) -> (grad_input, grad_weight, grad_bias)
OpSharding layer_norm_backward_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[1];
  int64_t axis = in.ndim() - static_cast<int64_t>(info.arg(2).toIntVector().size());
  Placements p = replicate_dims_from(in.placements, axis);
  OpSharding s;
  s.inputs.resize(info.num_args());
  for (size_t a : {size_t{0}, size_t{1}, size_t{3}, size_t{4}}) {
    if (info.specs[a]) {
      s.inputs[a] = p;
    }
  }
  for (size_t a : {size_t{5}, size_t{6}}) {
    if (a < info.num_args() && info.specs[a]) {
      s.inputs[a] = replicate_all(info.mesh_ndim());
    }
  }
  // Weight and bias gradients sum over the batch dims: partial where those are sharded.
  Placements wb;
  for (const auto& x : p) {
    wb.push_back(x.is_shard() ? Placement::partial(ReduceOp::Sum) : Placement::replicate());
  }
  s.outputs = {p, wb, wb};
  std::vector<int64_t> normalized = info.arg(2).toIntVector();
  s.output_shapes = {in.shape, normalized, normalized};
  return s;
}

// Attention on [batch, heads, seq, head_dim] (the CPU flash kernels that
// scaled_dot_product_attention picks): batch or head shards stay local, sequence and
// head_dim are gathered. Outputs: out like the query, logsumexp [batch, heads, seq].
Placements attention_placements(const DTensorSpec& q) {
  Placements p;
  for (const auto& x : q.placements) {
    p.push_back(x.is_shard() && (x.dim() == 0 || x.dim() == 1) ? x : Placement::replicate());
  }
  return p;
}

OpSharding attention_inputs(const OpInfo& info, std::initializer_list<size_t> sharded,
                            const Placements& p) {
  OpSharding s;
  s.inputs.resize(info.num_args());
  for (size_t a = 0; a < info.num_args(); ++a) {
    if (info.specs[a]) {
      s.inputs[a] = replicate_all(info.mesh_ndim()); // masks
    }
  }
  for (size_t a : sharded) {
    if (info.specs[a]) {
      s.inputs[a] = p;
    }
  }
  return s;
}

// _fused_sdp_choice(q, k, v, ...) -> int: only picks a kernel.
OpSharding sdp_choice_rule(const OpInfo& info) {
  return attention_inputs(info, {0, 1, 2}, attention_placements(*info.specs[0]));
}

// _scaled_dot_product_flash_attention_for_cpu(q, k, v, ...) -> (output, logsumexp)
OpSharding flash_attention_rule(const OpInfo& info) {
  const DTensorSpec& q = *info.specs[0];
  Placements p = attention_placements(q);
  OpSharding s = attention_inputs(info, {0, 1, 2}, p);
  s.outputs = {p, p};
  s.output_shapes = {q.shape, {q.shape[0], q.shape[1], q.shape[2]}};
  return s;
}

// ..._backward(grad_out, q, k, v, out, logsumexp, ...) -> (grad_q, grad_k, grad_v)
OpSharding flash_attention_backward_rule(const OpInfo& info) {
  Placements p = attention_placements(*info.specs[1]);
  OpSharding s = attention_inputs(info, {0, 1, 2, 3, 4, 5}, p);
  s.outputs = {p, p, p};
  s.output_shapes = {info.specs[1]->shape, info.specs[2]->shape, info.specs[3]->shape};
  return s;
}

// embedding(weight [V, E], indices, ...): a column-sharded (embedding-dim) weight gives an
// output sharded on its last dim; sharded indices give an output sharded the same way. A
// vocabulary-sharded weight is gathered (masked partial lookups are not implemented).
OpSharding embedding_rule(const OpInfo& info) {
  const DTensorSpec& w = *info.specs[0];
  const DTensorSpec& idx = *info.specs[1];
  const size_t n = static_cast<size_t>(info.mesh_ndim());
  Placements want_w(n, Placement::replicate());
  Placements want_i(n, Placement::replicate());
  Placements out(n, Placement::replicate());
  for (size_t i = 0; i < n; ++i) {
    if (w.placements[i].is_shard(1) && !idx.placements[i].is_shard()) {
      want_w[i] = w.placements[i];
      out[i] = Placement::shard(idx.ndim());
    } else if (idx.placements[i].is_shard()) {
      want_i[i] = idx.placements[i];
      out[i] = idx.placements[i];
    }
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = want_w;
  s.inputs[1] = want_i;
  s.outputs.push_back(out);
  std::vector<int64_t> shape = idx.shape;
  shape.push_back(w.shape[1]);
  s.output_shapes.push_back(shape);
  return s;
}

// embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale) -> [V, E]
OpSharding embedding_backward_rule(const OpInfo& info) {
  const DTensorSpec& g = *info.specs[0];
  const DTensorSpec& idx = *info.specs[1];
  const size_t n = static_cast<size_t>(info.mesh_ndim());
  Placements want_g(n, Placement::replicate());
  Placements want_i(n, Placement::replicate());
  Placements out(n, Placement::replicate());
  for (size_t i = 0; i < n; ++i) {
    const Placement& gp = g.placements[i];
    if (gp.is_shard(g.ndim() - 1) && !idx.placements[i].is_shard()) {
      want_g[i] = gp; // embedding dim sharded: the weight gradient is column-sharded
      out[i] = Placement::shard(1);
    } else if (idx.placements[i].is_shard() && gp == idx.placements[i]) {
      want_g[i] = gp; // rows of the batch split over ranks: partial sums of the gradient
      want_i[i] = gp;
      out[i] = Placement::partial(ReduceOp::Sum);
    } else if (gp.is_partial() && !idx.placements[i].is_shard()) {
      want_g[i] = gp; // linear in grad_output
      out[i] = gp;
    }
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = want_g;
  s.inputs[1] = want_i;
  s.outputs.push_back(out);
  s.output_shapes.push_back({info.arg(2).toInt(), g.shape.back()});
  return s;
}

} // namespace

// nll_loss_forward / nll_loss_backward (and 2d): all_replicate, computed on whole tensors (a
// mean over a sharded batch is not a single partial reduction).
void register_nn_ops() {
  register_rule("aten::_softmax", softmax_rule);
  register_rule("aten::_log_softmax", softmax_rule);
  register_rule("aten::_softmax_backward_data", softmax_backward_rule);
  register_rule("aten::_log_softmax_backward_data", softmax_backward_rule);
  register_rule("aten::native_layer_norm", layer_norm_rule);
  register_rule("aten::native_layer_norm_backward", layer_norm_backward_rule);
  register_rule("aten::embedding", embedding_rule);
  register_rule("aten::_fused_sdp_choice", sdp_choice_rule);
  register_rule("aten::_scaled_dot_product_flash_attention_for_cpu", flash_attention_rule);
  register_rule("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                flash_attention_backward_rule);
  register_rule("aten::embedding_dense_backward", embedding_backward_rule);
  register_rule("aten::nll_loss_forward", all_replicate);
  register_rule("aten::nll_loss_backward", all_replicate);
  register_rule("aten::nll_loss2d_forward", all_replicate);
  register_rule("aten::nll_loss2d_backward", all_replicate);
}

} // namespace dtensor::detail
