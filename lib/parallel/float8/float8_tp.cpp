// Float8 linears under tensor parallelism (float8_mm.h): the input a DTensor, the weight
// sharded by ColwiseParallel / RowwiseParallel (and by fully_shard over them).
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <dtensor/dtensor.h>

#include "internal/check.h"
#include "parallel/float8/float8_mm.h"
#include "parallel/float8/float8_all_gather.h"
#include "parallel/tp/tensor_parallel.h"
#include "tensor/dispatch/interceptors.h"

namespace dtensor::detail {

namespace {

// [Note: float8 under tensor parallelism]
// A float8 linear on shards computes what the unsharded layer computes: every scale is the
// whole operand's. Each product runs on the local shards (x [M, K] against the weight [N, K]);
// an operand sharded along what its amax reduces (a tensorwise amax reduces everything, a
// rowwise one the product's inner dimension) has its local amaxes all-reduced (MAX) over the
// mesh dimensions that shard it, batched into one all-reduce per group in forward and one in
// backward ([Note: batched amax all-reduce] in float8_mm.cpp). ColwiseParallel (x Replicate,
// weight Shard(0)): the output gradient in backward, and a tensorwise weight in forward.
// RowwiseParallel (x Shard(-1), weight Shard(1)): x and the weight in forward (the Partial
// output's pieces share their scales), and tensorwise operands in backward. The activations
// move in high precision (torchtitan's float8 since its #3127). The placements are those of
// the high-precision matmul: Shard(-1) out of a Shard(0) weight, Partial out of sharded in
// features, x's leading shards kept, and the gradients Partial where the other operand's
// shards summed into them.
struct Layout {
  Placements x, w, out, x_grad, w_grad;
  c10::intrusive_ptr<Float8Sharding> sharding = c10::make_intrusive<Float8Sharding>();
};

Layout layout_of(const DTensor& x, const DTensor& w) {
  const int64_t last = x.dim() - 1;
  const DeviceMesh& mesh = x.device_mesh();
  Layout l;
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    const Placement& wp = w.placements()[static_cast<size_t>(i)];
    const Placement& xp = x.placements()[static_cast<size_t>(i)];
    DTENSOR_CHECK(!wp.is_partial(),
                  "float8_linear: the weight is {} on mesh dimension {}; a float8 weight must "
                  "be Replicate, Shard(0) or Shard(1)",
                  to_string(w.placements()), i);
    const Group g = mesh.get_group(i);
    const bool k_sharded = wp.is_shard(1);
    // x's leading dimensions stay sharded only beside a replicated weight (a Shard(0) weight
    // shards the output's last dimension on this mesh dimension: x is gathered instead).
    const bool m_sharded = wp.is_replicate() && xp.is_shard() && xp.dim() != last;
    l.x.push_back(k_sharded ? Placement::shard(last) : (m_sharded ? xp : Placement::replicate()));
    l.w.push_back(wp);
    l.x_grad.push_back(wp.is_shard(0) ? Placement::partial() : l.x.back());
    l.w_grad.push_back(m_sharded ? Placement::partial() : wp);
    l.out.push_back(k_sharded        ? Placement::partial()
                    : m_sharded      ? xp
                    : wp.is_shard(0) ? Placement::shard(last)
                                     : Placement::replicate());
    if (g.size() == 1) {
      continue; // one rank holds the whole: nothing to all-reduce
    }
    if (k_sharded) {
      l.sharding->x_cols.push_back(g);
      l.sharding->w_cols.push_back(g);
    } else if (m_sharded) {
      l.sharding->x_rows.push_back(g);
    }
    if (wp.is_shard(0)) {
      l.sharding->w_rows.push_back(g);
    }
  }
  return l;
}

// [Note: float8 on the tensor-parallel seam] A parallelized Linear's float8 hook computes its
// product above the ops, so it does what the ops do for the module ([Note: tensor parallelism
// without module hooks] in lib/parallel/tp/tp_dispatch.cpp): a plain input is the style's
// input layout, which only Replicate can be (from_local without communication; its backward
// hands the input a plain, whole gradient), and the result is tagged as the module's
// activation, so that the seam's post-forward takes it to the style's output layout.
std::shared_ptr<const TpTag> tp_tag_of(const at::Tensor& source, const at::Tensor& weight) {
  auto tag = tp_tag(source);
  return tag ? tag : tp_tag(weight);
}

at::Tensor tp_input(const at::Tensor& x, const TpTag* tag, const DeviceMesh& mesh) {
  if (is_dtensor(x)) {
    return x;
  }
  const Placement in =
      tag && tag->layouts && tag->layouts->input ? *tag->layouts->input : Placement::replicate();
  DTENSOR_CHECK(in.is_replicate(),
                "float8_linear: {} on module '{}' takes its input as {}, but it got a plain "
                "tensor {}; a plain tensor can only stand for a Replicate input",
                tag->style, tag->module_name, in.to_string(), c10::str(x.sizes()));
  return DTensor::from_local(x, mesh,
                             Placements(static_cast<size_t>(mesh.ndim()), Placement::replicate()),
                             x.sizes().vec());
}

} // namespace

bool float8_tp_weight(const at::Tensor& weight) {
  if (!is_dtensor(weight)) {
    return false;
  }
  LocalRegion region;
  return tp_tag_of(local_source(weight), weight) != nullptr;
}

at::Tensor float8_linear_tp(const at::Tensor& x_in, const at::Tensor& weight,
                            const at::Tensor& bias, Float8Recipe recipe) {
  at::Tensor source;
  {
    LocalRegion region; // fully_shard's unsharded value ([Note: local regions])
    source = local_source(weight);
  }
  const std::shared_ptr<const TpTag> tag = tp_tag_of(source, weight);
  const at::Tensor x = is_dtensor(source) && !is_dtensor(x_in)
                           ? tp_input(x_in, tag.get(), DTensor(source).device_mesh())
                           : x_in;
  DTensor dx(x);
  DTENSOR_CHECK(is_dtensor(source),
                "float8_linear: the input is a DTensor {} on {} but the weight is not; "
                "distribute the weight (tensor parallelism) or pass a plain input",
                to_string(dx.placements()), dx.device_mesh().to_string());
  DTensor dw(source);
  DTENSOR_CHECK(dw.device_mesh() == dx.device_mesh(),
                "float8_linear: the input is on {} and the weight on {}; they must share a mesh",
                dx.device_mesh().to_string(), dw.device_mesh().to_string());
  DTENSOR_CHECK(x.size(-1) == dw.size(1), "float8_linear: input {} does not fit weight {}",
                c10::str(x.sizes()), c10::str(dw.sizes()));
  const Layout l = layout_of(dx, dw);
  DTENSOR_CHECK(source.is_same(weight) || l.w_grad == l.w,
                "float8_linear: the input {} is sharded along its leading dimensions and the "
                "weight is fully_shard's; replicate the input's leading dimensions over the "
                "weight's mesh first",
                to_string(dx.placements()));
  if (dx.placements() != l.x) {
    dx = dx.redistribute(dx.device_mesh(), l.x);
  }
  const at::Tensor x_local = dx.to_local(l.x_grad);
  at::Tensor w_local;
  {
    LocalRegion region;
    w_local = DTensor(weight).to_local(l.w_grad);
  }
  // Gathered in float8 by fully_shard (tp over one rank only): its scale, the whole weight's.
  const at::Tensor scale = float8_all_gather_scale(weight);
  DTENSOR_CHECK(!scale.defined() || (l.sharding->w_rows.empty() && l.sharding->w_cols.empty()),
                "float8_linear: fully_shard gathers this weight in float8 and tensor parallelism "
                "shards it ({}); the float8 all-gather does not compose with tensor parallelism "
                "over more than one rank",
                to_string(dw.placements()));
  const at::Tensor y_local = float8_mm(x_local, w_local, scale, recipe, l.sharding);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = dw.size(0);
  at::Tensor y = DTensor::from_local(y_local, dx.device_mesh(), l.out, shape);
  if (tag && tag->activation) {
    set_tp_tag(y, tag->activation);
  }
  return bias.defined() ? y + bias : y;
}

} // namespace dtensor::detail
