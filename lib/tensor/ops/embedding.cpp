// Embedding lookups and their backward, with vocabulary-sharded tables looked up in place
// ([Note: masked lookups]).
#include <ATen/ATen.h>

#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

// [Note: masked lookups]
// A table sharded by rows (the vocabulary: RowwiseParallel's embedding, a vocab-parallel
// embedding) on mesh dim m, indices whole on m: each rank looks up the indices that fall in
// its row range (shifted to its local rows), and zeroes the rows of the others. The sum over
// m of these outputs is the lookup in the whole table, so the output is Partial(sum): one
// all-reduce (or reduce-scatter) of the output when it is used, instead of an all-gather of
// the table. PyTorch's _MaskPartial placement does the same with the mask kept on the
// placement until the reduction; here the mask is applied in the local kernel, so the
// output is an ordinary Partial(sum) (redistributable, reducible, checkpointable as any).
// One mesh dim is looked up this way; a table sharded by rows on more mesh dims is gathered
// over the others first.
void masked_lookup(const OpInfo& info, const OpSharding& sharding, torch::jit::Stack* stack) {
  const size_t n = info.num_args();
  const size_t base = stack->size() - n;
  const at::Tensor weight = (*stack)[base].toTensor();
  const at::Tensor indices = (*stack)[base + 1].toTensor();
  const DTensorSpec& w = *info.specs[0];
  const Placements& want = *sharding.inputs[0];
  int64_t m = 0;
  while (!want[static_cast<size_t>(m)].is_shard(0)) {
    ++m;
  }
  const int64_t rows = w.shape[0];
  const int64_t k = info.mesh->size(m);
  const int64_t at = info.mesh->get_coordinate().value()[static_cast<size_t>(m)];
  const int64_t offset = chunk_offset(rows, k, at);
  const int64_t length = chunk_size(rows, k, at);
  at::Tensor outside = (indices < offset) | (indices >= offset + length);
  std::vector<int64_t> shape = indices.sizes().vec();
  shape.push_back(weight.size(1));
  at::Tensor out;
  if (length == 0) {
    out = at::zeros(shape, weight.options());
  } else {
    at::Tensor local = at::where(outside, 0, indices - offset);
    out = at::embedding(weight, local).masked_fill_(outside.unsqueeze(-1), 0);
  }
  stack->resize(base);
  stack->emplace_back(out);
}

// embedding(weight [V, E], indices, padding_idx, scale_grad_by_freq, sparse): a
// column-sharded (embedding-dim) weight gives an output sharded on its last dim; sharded
// indices give an output sharded the same way; a row-sharded (vocabulary) weight with whole
// indices gives a Partial(sum) output ([Note: masked lookups]).
OpSharding embedding_rule(const OpInfo& info) {
  const DTensorSpec& w = *info.specs[0];
  const DTensorSpec& idx = *info.specs[1];
  const size_t n = static_cast<size_t>(info.mesh_ndim());
  Placements want_w(n, Placement::replicate());
  Placements want_i(n, Placement::replicate());
  Placements out(n, Placement::replicate());
  bool masked = false;
  for (size_t i = 0; i < n; ++i) {
    if (w.placements[i].is_shard(1) && !idx.placements[i].is_shard()) {
      want_w[i] = w.placements[i];
      out[i] = Placement::shard(idx.ndim());
    } else if (idx.placements[i].is_shard()) {
      want_i[i] = idx.placements[i];
      out[i] = idx.placements[i];
    } else if (w.placements[i].is_shard(0) && !masked) {
      want_w[i] = w.placements[i];
      out[i] = Placement::partial(ReduceOp::Sum);
      masked = true;
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
  if (masked) {
    s.local_kernel = masked_lookup;
  }
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

void register_embedding_ops() {
  register_rule("aten::embedding", embedding_rule);
  register_rule("aten::embedding_dense_backward", embedding_backward_rule);
}

} // namespace dtensor::detail
