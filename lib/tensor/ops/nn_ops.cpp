// Neural-network ops: softmax / log_softmax, layer norm, nll_loss (what
// cross_entropy decomposes to), and their backward kernels.
#include "internal/check.h"
#include "tensor/ops/registry.h"

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
  register_rule("aten::nll_loss_forward", all_replicate);
  register_rule("aten::nll_loss_backward", all_replicate);
  register_rule("aten::nll_loss2d_forward", all_replicate);
  register_rule("aten::nll_loss2d_backward", all_replicate);
}

} // namespace dtensor::detail
