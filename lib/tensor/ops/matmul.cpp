// Matrix products: mm, addmm, bmm, baddbmm, mv. Per mesh dimension the rule picks the
// cheapest of the layouts a product can be computed in locally:
//   A Shard(rows) x B Replicate     -> Shard(rows)
//   A Replicate   x B Shard(cols)   -> Shard(cols)
//   A Shard(inner) x B Shard(inner) -> Partial(sum)
//   A Partial     x B Replicate     -> Partial(sum), and the mirror image
//   A Shard(batch) x B Shard(batch) -> Shard(batch)       (bmm only)
//   A Replicate   x B Replicate     -> Replicate
#include <algorithm>
#include <limits>

#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

struct Layout {
  Placement a, b, out;
};

// [Note: product costs]
// What moving a factor from `from` to `to` on mesh dimension `i` costs, in elements: nothing
// when it stays or is cut locally from a replica; otherwise a latency worth kLatency
// elements per collective plus the elements the factor spans within that dimension's group
// (its global size over the shard degrees of the other mesh dimensions; an all-reduce moves
// them twice). A shard moved to another dimension (an all-to-all) pays a second latency, so
// that, as in PyTorch's redistribute costs, a gather of the same size is preferred. Small
// factors thus compare by collectives, large ones by volume. Counting collectives alone tied
// gathering the activation against gathering the weight whenever both were sharded, and the
// first layout won: the row-wise FFN weight of an 8B model (4096 x 14336) was gathered in
// every backward and its product all-to-all'ed back, where the gradient is smaller.
constexpr int64_t kLatency = 1 << 16;

int64_t cost(const DTensorSpec& spec, const DeviceMesh& mesh, size_t i, const Placement& to) {
  const Placement& from = spec.placements[i];
  if (from == to || from.is_replicate()) {
    return 0;
  }
  int64_t elements = 1;
  for (int64_t s : spec.shape) {
    elements *= s;
  }
  for (size_t j = 0; j < spec.placements.size(); ++j) {
    if (j != i && spec.placements[j].is_shard()) {
      elements /= std::max<int64_t>(1, mesh.size(static_cast<int64_t>(j)));
    }
  }
  if (from.is_partial() && to.is_replicate()) {
    return 2 * (kLatency + elements);
  }
  return (from.is_shard() && to.is_shard() ? 2 * kLatency : kLatency) + elements;
}

std::vector<Layout> layouts(int64_t batch) {
  // batch = 1 for bmm (dims shifted by one), 0 for mm.
  Placement R = Placement::replicate();
  Placement P = Placement::partial(ReduceOp::Sum);
  std::vector<Layout> l = {
      {R, R, R},
      {Placement::shard(batch + 0), R, Placement::shard(batch + 0)},
      {R, Placement::shard(batch + 1), Placement::shard(batch + 1)},
      {Placement::shard(batch + 1), Placement::shard(batch + 0), P},
      {P, R, P},
      {R, P, P},
  };
  if (batch == 1) {
    l.push_back({Placement::shard(0), Placement::shard(0), Placement::shard(0)});
  }
  return l;
}

// a_index / b_index: argument positions of the two factors; bias_index: -1 or the added term.
OpSharding product(const OpInfo& info, size_t a_index, size_t b_index, int bias_index, int64_t batch) {
  const DTensorSpec* a = info.specs[a_index] ? &*info.specs[a_index] : nullptr;
  const DTensorSpec* b = info.specs[b_index] ? &*info.specs[b_index] : nullptr;
  if (a == nullptr || b == nullptr) {
    fail_unsupported(info, "both factors must be DTensors");
  }
  const size_t mesh_ndim = static_cast<size_t>(info.mesh_ndim());
  Placements want_a(mesh_ndim, Placement::replicate());
  Placements want_b(mesh_ndim, Placement::replicate());
  Placements out(mesh_ndim, Placement::replicate());
  // The added term broadcasts against the output: it is sharded where the output is (when
  // it has that dimension), partitioned where the output is Partial. Its move counts too.
  const DTensorSpec* bias = bias_index >= 0 && info.specs[static_cast<size_t>(bias_index)]
                                ? &*info.specs[static_cast<size_t>(bias_index)]
                                : nullptr;
  auto bias_want = [&](const Placement& o) {
    if (o.is_shard()) {
      const int64_t d = o.dim() - (batch + 2 - bias->ndim());
      return d >= 0 && bias->shape[static_cast<size_t>(d)] != 1 ? Placement::shard(d)
                                                                 : Placement::replicate();
    }
    return o.is_partial() ? o : Placement::replicate();
  };
  const DeviceMesh& mesh = *info.mesh;
  for (size_t i = 0; i < mesh_ndim; ++i) {
    int64_t best = std::numeric_limits<int64_t>::max();
    for (const Layout& l : layouts(batch)) {
      const int64_t c = cost(*a, mesh, i, l.a) + cost(*b, mesh, i, l.b) +
                        (bias != nullptr ? cost(*bias, mesh, i, bias_want(l.out)) : 0);
      if (c < best) {
        best = c;
        want_a[i] = l.a;
        want_b[i] = l.b;
        out[i] = l.out;
      }
    }
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[a_index] = want_a;
  s.inputs[b_index] = want_b;
  if (bias != nullptr) {
    Placements want_bias(mesh_ndim, Placement::replicate());
    for (size_t i = 0; i < mesh_ndim; ++i) {
      want_bias[i] = bias_want(out[i]);
    }
    s.inputs[static_cast<size_t>(bias_index)] = want_bias;
  }
  s.outputs.push_back(out);
  return s;
}

// mv: A [m, n] x v [n] -> [m], the layouts of mm with one column.
OpSharding mv_rule(const OpInfo& info) {
  if (!info.specs[0] || !info.specs[1]) {
    fail_unsupported(info, "both factors must be DTensors");
  }
  const DTensorSpec& a = *info.specs[0];
  const DTensorSpec& v = *info.specs[1];
  const Placement R = Placement::replicate();
  const Placement P = Placement::partial(ReduceOp::Sum);
  const std::vector<Layout> mv_layouts = {
      {R, R, R}, {Placement::shard(0), R, Placement::shard(0)}, {Placement::shard(1), Placement::shard(0), P},
      {P, R, P}, {R, P, P},
  };
  const size_t n = static_cast<size_t>(info.mesh_ndim());
  Placements want_a(n, R);
  Placements want_v(n, R);
  Placements out(n, R);
  for (size_t i = 0; i < n; ++i) {
    int64_t best = std::numeric_limits<int64_t>::max();
    for (const Layout& l : mv_layouts) {
      const int64_t c = cost(a, *info.mesh, i, l.a) + cost(v, *info.mesh, i, l.b);
      if (c < best) {
        best = c;
        want_a[i] = l.a;
        want_v[i] = l.b;
        out[i] = l.out;
      }
    }
  }
  OpSharding s;
  s.inputs = {want_a, want_v};
  s.outputs.push_back(out);
  return s;
}

OpSharding mm_rule(const OpInfo& info) { return product(info, 0, 1, -1, 0); }
OpSharding addmm_rule(const OpInfo& info) { return product(info, 1, 2, 0, 0); }
OpSharding bmm_rule(const OpInfo& info) { return product(info, 0, 1, -1, 1); }
OpSharding baddbmm_rule(const OpInfo& info) { return product(info, 1, 2, 0, 1); }

} // namespace

void register_matmul_ops() {
  register_rule("aten::mm", mm_rule);
  register_rule("aten::mv", mv_rule);
  register_rule("aten::addmm", addmm_rule);
  register_rule("aten::addmm_", addmm_rule);
  register_rule("aten::bmm", bmm_rule);
  register_rule("aten::baddbmm", baddbmm_rule);
  register_rule("aten::baddbmm_", baddbmm_rule);
}

} // namespace dtensor::detail
