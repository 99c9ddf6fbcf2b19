// The context-parallel methods that split heads around the sequence-split ones (methods.h):
// Ulysses and hierarchical (Ulysses inside groups, the ring across them).
#include <dtensor/context_parallel.h>
#include <dtensor/dtensor.h>
#include <dtensor/process_group.h>

#include <ATen/ATen.h>

#include "internal/check.h"
#include "parallel/cp/methods.h"

namespace dtensor::detail::cp {

namespace {

// [Note: Ulysses]
// DeepSpeed-Ulysses: the kernel splits the heads, not the sequence. This rank's rows of q, k
// and v (every head), stacked per head group, go through one all-to-all that leaves each
// rank the whole sequence of its Hq/cp query heads and Hkv/cp key / value heads (grouped-query
// heads travel unrepeated: query group j's keys are key group j). The rows are put in global
// order, the block engine computes attention over the whole sequence under the layout's masks
// (causal, documents) as one rank would, and a second all-to-all takes the output back to this
// rank's rows of every head. Both all-to-alls are dtensor's Shard(seq) <-> Shard(heads)
// redistributions, so backward mirrors them: one all-to-all for the output's gradient, one for
// q / k / v's. Per call: forward 2 all-to-alls, backward 2, each sending (cp-1)/cp of its
// tensor (q, k, v: (Hq + 2 Hkv) L d elements; the output: Hq L d). Every rank has the same
// work whatever the layout (an equal share of the heads over the whole sequence): no
// balancing is needed, and any layout works (it is the other layers' row order).
//
// [Note: hierarchical]
// Ulysses needs the heads to divide by cp and moves every activation across all cp ranks; the
// ring moves K/V only, cp - 1 times. The hierarchical method ("USP", Megatron's a2a + p2p)
// does Ulysses inside groups of u = ulysses_degree consecutive cp ranks (a node's, where
// all-to-all is cheap) and the ring across the cp / u groups: after the group's all-to-all a
// rank holds 1/u of the heads over its group's rows (CpLayout::grouped), and rings with the
// ranks of the other groups that hold the same heads (the ranks with its index in their
// groups); the output goes back by the group's all-to-all. Per call: forward 2 all-to-alls
// over u ranks and cp/u - 1 ring exchanges of K/V (the group's rows of 1/u of the heads),
// backward 2 all-to-alls and 2(cp/u - 1) exchanges. u = cp is Ulysses, u = 1 the ring.

// The heads of q, k and v stacked per group of `n`: [B, n * (hq + 2 hkv), L, d], group j's
// query heads, then its key and value heads.
at::Tensor stack_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t n) {
  const int64_t b = q.size(0), len = q.size(2), d = q.size(3);
  const int64_t hq = q.size(1) / n, hkv = k.size(1) / n;
  return at::cat({q.reshape({b, n, hq, len, d}), k.reshape({b, n, hkv, len, d}),
                  v.reshape({b, n, hkv, len, d})},
                 2)
      .reshape({b, n * (hq + 2 * hkv), len, d});
}

// `t`, this rank's piece of a tensor of global `shape` sharded on dim `from` over the 1-D
// `mesh`, resharded on dim `to` (one all-to-all; backward the mirror).
at::Tensor reshard(const at::Tensor& t, const DeviceMesh& mesh, int64_t from, int64_t to,
                   std::vector<int64_t> shape) {
  return DTensor::from_local(t, mesh, {Placement::shard(from)}, std::move(shape))
      .redistribute(mesh, {Placement::shard(to)})
      .to_local();
}

void check_heads(const at::Tensor& q, const at::Tensor& k, int64_t n, const char* method,
                 const char* degree) {
  DTENSOR_CHECK(q.size(1) % n == 0 && k.size(1) % n == 0,
                "context_parallel_attention ({}): {} query heads and {} key / value heads "
                "(this rank's, after tensor parallelism) must both be multiples of {} = {}: "
                "each rank computes the whole sequence of an equal share of the heads",
                method, q.size(1), k.size(1), degree, n);
}

// The global positions of ranks first..first+n-1's rows, in rank order.
at::Tensor positions_of(const CpLayout& layout, int64_t first, int64_t n) {
  std::vector<at::Tensor> order;
  for (int64_t r = first; r < first + n; ++r) {
    order.push_back(layout.positions(r));
  }
  return at::cat(order);
}

// The cp mesh's all-to-all group (this rank's u consecutive ranks) and ring group (the ranks
// with this rank's index in theirs), as 1-D meshes: created on their first use (only their
// members call new_group, all in the same order: the all-to-all's first), cached by ranks.
std::pair<DeviceMesh, DeviceMesh> hierarchy(const DeviceMesh& mesh, int64_t u) {
  const std::vector<int>& ranks = mesh.ranks();
  const int64_t n = mesh.size(), me = mesh.get_local_rank(0);
  std::vector<int> a2a, ring;
  for (int64_t i = 0; i < u; ++i) {
    a2a.push_back(ranks[static_cast<size_t>(me / u * u + i)]);
  }
  for (int64_t o = 0; o < n / u; ++o) {
    ring.push_back(ranks[static_cast<size_t>(o * u + me % u)]);
  }
  const Group inner = new_group(a2a, "cp_a2a"), outer = new_group(ring, "cp_ring");
  return {DeviceMesh::from_group(inner, mesh.device_type(), {"cp_a2a"}),
          DeviceMesh::from_group(outer, mesh.device_type(), {"cp_ring"})};
}

} // namespace

at::Tensor ulysses(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const DeviceMesh& mesh, const CpLayout& layout,
                   const ContextParallelOptions& options, double scale, at::Tensor* lse) {
  const int64_t n = layout.cp(), b = q.size(0), d = q.size(3), s = layout.seq_len();
  check_heads(q, k, n, "Ulysses", "cp");
  const int64_t hq = q.size(1) / n, hkv = k.size(1) / n, g = hq + 2 * hkv;
  const at::Tensor order = positions_of(layout, 0, n);
  const at::Tensor rank_major = order.to(q.device()); // row i's global position
  const at::Tensor global = at::argsort(order).to(q.device());
  const at::Tensor heads =
      reshard(stack_heads(q, k, v, n), mesh, 2, 1, {b, n * g, s, d}).index_select(2, global);
  const std::vector<at::Tensor> part = heads.split_with_sizes({hq, hkv, hkv}, 1);
  auto state = c10::make_intrusive<CallState>(CpLayout(s, 1, CpBalance::None, layout.documents()),
                                              mesh, options.causal(), scale);
  state->self = 0;
  const std::vector<at::Tensor> r =
      gathered_attention(part[0], at::stack({part[1], part[2]}), state);
  if (lse != nullptr) { // not differentiable: one more all-to-all, only when asked for
    *lse = reshard(r[1].index_select(2, rank_major).unsqueeze(-1), mesh, 1, 2, {b, n * hq, s, 1})
               .squeeze(-1);
  }
  return reshard(r[0].index_select(2, rank_major), mesh, 1, 2, {b, n * hq, s, d});
}

at::Tensor hierarchical(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const DeviceMesh& mesh, const CpLayout& layout,
                        const ContextParallelOptions& options, double scale, at::Tensor* lse) {
  const int64_t n = layout.cp(), u = options.ulysses_degree();
  DTENSOR_CHECK(u >= 1 && n % u == 0,
                "context_parallel_attention (hierarchical): ulysses_degree {} must divide cp = "
                "{} (the ranks of each all-to-all group; cp / it groups ring)",
                u, n);
  check_heads(q, k, u, "hierarchical", "ulysses_degree");
  const auto [inner, outer] = hierarchy(mesh, u);
  const int64_t b = q.size(0), len = q.size(2), d = q.size(3), group = mesh.get_local_rank(0) / u;
  const int64_t hq = q.size(1) / u, hkv = k.size(1) / u, g = hq + 2 * hkv;
  // The group's rows in global order, and back.
  const at::Tensor sorted = at::argsort(positions_of(layout, group * u, u)).to(q.device());
  const at::Tensor unsorted = at::argsort(sorted);
  const at::Tensor heads =
      reshard(stack_heads(q, k, v, u), inner, 2, 1, {b, u * g, u * len, d}).index_select(2, sorted);
  const std::vector<at::Tensor> part = heads.split_with_sizes({hq, hkv, hkv}, 1);
  auto state = c10::make_intrusive<CallState>(layout.grouped(u), outer, options.causal(), scale);
  const std::vector<at::Tensor> r = ring_attention(part[0], part[1], part[2], state);
  if (lse != nullptr) {
    *lse =
        reshard(r[1].index_select(2, unsorted).unsqueeze(-1), inner, 1, 2, {b, u * hq, u * len, 1})
            .squeeze(-1);
  }
  return reshard(r[0].index_select(2, unsorted), inner, 1, 2, {b, u * hq, u * len, d});
}

} // namespace dtensor::detail::cp
