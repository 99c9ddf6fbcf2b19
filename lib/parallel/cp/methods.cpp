// context_parallel_attention: the all-gather and ring methods over the block engine (the
// Ulysses and hierarchical ones, which split heads around them, in head_methods.cpp).
#include <dtensor/collectives.h>
#include <dtensor/context_parallel.h>
#include <dtensor/dtensor.h>
#include <dtensor/process_group.h>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include "internal/check.h"
#include "mesh/dispatch_keys.h"
#include "parallel/cp/blocks.h"
#include "parallel/cp/methods.h"

namespace dtensor {

// [Note: two methods]
// Both compute, for this rank's query rows, attention over every rank's key rows, block by
// block ([Note: the block plan] in blocks.cpp), merging the blocks' outputs by their
// log-sum-exp in fp32; they differ in how the keys and values get there.
//  - All-gather: K and V, stacked into one tensor, are gathered from every rank (one
//    all-gather) and backward, where each rank's dK/dV is only its own queries' share, sums
//    them on their way back (one reduce-scatter), each overlapped with the rank's own block
//    ([Note: the all-gather beside the own block]). The whole sequence's K/V is saved for
//    backward: O(S) per rank. Per call: forward one all-gather, backward one reduce-scatter
//    (PyTorch's SDPA path: forward one all-gather, backward one all-gather and cp
//    all-to-alls; its flex path two and two). Under a document mask the rows move by need
//    instead ([Note: only the rows a rank needs]).
//  - Ring: each rank passes the K/V block it holds to the next rank and receives the previous
//    one's, cp - 1 times; each exchange is posted before the kernels of the block in hand run, so
//    the transfer overlaps the compute (Gloo progresses point-to-point on its own threads).
//    Backward passes K/V round again and sends each source's dK/dV, accumulated by every rank
//    its queries reached, home: the step-0 share stays home and the rest travels cp - 1 hops
//    (PyTorch's ring sends it cp hops). Only local rows are saved, and at most two K/V blocks
//    live at once: O(S/cp) per rank. Per call: forward cp - 1 sends and receives, backward
//    2(cp - 1) of each.

namespace {

using detail::cp::Accumulator;
using detail::cp::CallState;
using detail::cp::Plan;
using detail::cp::plan_blocks;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Tags of the ring's transfers (between the same two ranks of the cp group, K/V and dK/dV may
// be in flight at once).
constexpr int kKvTag = 0x43500000;
constexpr int kGradTag = 0x43510000;

void save_state(AutogradContext* ctx, c10::intrusive_ptr<CallState> state) {
  ctx->saved_data["cp"] = c10::IValue::make_capsule(std::move(state));
}

const CallState& saved_state(AutogradContext* ctx) {
  return *c10::static_intrusive_pointer_cast<CallState>(ctx->saved_data["cp"].toCapsule());
}

void note_kv_bytes(int64_t bytes) {
  auto& s = detail::cp::stats();
  s.peak_kv_bytes = std::max(s.peak_kv_bytes, bytes);
}

int64_t bytes_of(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// The end of both methods' forward: every query row reached, the output in q's dtype; saved for
// backward `keep`, then the output and the log-sum-exp (in the kernel's dtype, its backward's
// input); the log-sum-exp returned beside the output, not differentiable.
variable_list finish_forward(AutogradContext* ctx, const Accumulator& acc, const at::Tensor& q,
                             std::vector<at::Tensor> keep, c10::intrusive_ptr<CallState> state) {
  detail::cp::check_complete(acc, state->layout);
  at::Tensor out = acc.out.to(q.scalar_type());
  keep.push_back(out);
  keep.push_back(acc.lse.to(acc.lse_dtype));
  ctx->save_for_backward(keep);
  save_state(ctx, std::move(state));
  ctx->mark_non_differentiable({acc.lse});
  return {out, acc.lse};
}

// q against the gathered K/V [2, B, Hkv, cp * L, d] (rank-major).
struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& kv,
                               c10::intrusive_ptr<CallState> state) {
    const CallState& st = *state;
    const int64_t len = st.layout.local_len();
    Accumulator acc(q);
    for (int64_t src = 0; src < st.layout.cp(); ++src) {
      at::Tensor block = kv.narrow(3, src * len, len);
      Plan plan = plan_blocks(st.layout, st.rank(), src, q.size(0), st.causal);
      detail::cp::forward_blocks(acc, plan, q, block[0], block[1], st.scale);
    }
    note_kv_bytes(bytes_of(kv));
    return finish_forward(ctx, acc, q, {q, kv}, std::move(state));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const CallState& st = saved_state(ctx);
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &kv = saved[1], &out = saved[2], &lse = saved[3];
    const int64_t len = st.layout.local_len();
    at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    at::Tensor dkv = at::zeros(kv.sizes(), kv.options().dtype(at::kFloat));
    for (int64_t src = 0; src < st.layout.cp(); ++src) {
      at::Tensor block = kv.narrow(3, src * len, len);
      at::Tensor dk = dkv[0].narrow(2, src * len, len), dv = dkv[1].narrow(2, src * len, len);
      Plan plan = plan_blocks(st.layout, st.rank(), src, q.size(0), st.causal);
      detail::cp::backward_blocks(plan, grads[0], q, block[0], block[1], out, lse, st.scale, dq, dk,
                                  dv);
    }
    return {dq.to(q.scalar_type()), dkv.to(kv.scalar_type()), at::Tensor()};
  }
};

// [Note: the all-gather beside the own block]
// Forward starts the K/V all-gather asynchronously and runs this rank's queries against its
// own keys (the block it needs no transfer for; under a causal mask the diagonal, the
// largest) while the other ranks' rows travel, then the rest. Backward runs the other
// sources' blocks first, starts the reduce-scatter of their dK/dV (this rank's own slot
// zero) and runs the own block beside it, adding its gradient to the reduced shard in fp32.
// The collectives and bytes are the redistribution's (Shard -> Replicate forward, Partial ->
// Shard backward, in K/V's dtype); the gathered K/V stays rank-major ([cp, 2, B, Hkv, L, d],
// no reordering copy). The merge takes the own block first, so the output rounds differently
// from rank order (within the kernels' tolerance).
struct GatheredKvFn : torch::autograd::Function<GatheredKvFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& kv,
                               c10::intrusive_ptr<CallState> state) {
    const CallState& st = *state;
    const int64_t cp = st.layout.cp(), me = st.rank();
    const at::Tensor local = kv.contiguous(); // [2, B, Hkv, L, d]
    at::Tensor gathered = at::empty(by_rank_shape(local, cp), local.options());
    at::Tensor flat = gathered.view(flat_shape(local, cp));
    Work work = all_gather_into_tensor(flat, local, st.mesh.get_group(), overlapped());
    Accumulator acc(q);
    for (int64_t i = 0; i < cp; ++i) { // the own block first, the others once gathered
      const int64_t src = (me + i) % cp;
      if (i == 1) {
        work.wait();
      }
      const at::Tensor block = i == 0 ? local : gathered[src];
      Plan plan = plan_blocks(st.layout, me, src, q.size(0), st.causal);
      detail::cp::forward_blocks(acc, plan, q, block[0], block[1], st.scale);
    }
    work.wait();
    note_kv_bytes(bytes_of(gathered));
    return finish_forward(ctx, acc, q, {q, gathered}, std::move(state));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const CallState& st = saved_state(ctx);
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &gathered = saved[1], &out = saved[2], &lse = saved[3];
    const int64_t cp = st.layout.cp(), me = st.rank();
    at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    at::Tensor dkv = at::zeros(gathered.sizes(), gathered.options().dtype(at::kFloat));
    auto run_block = [&](int64_t src, at::Tensor dk, at::Tensor dv) {
      Plan plan = plan_blocks(st.layout, me, src, q.size(0), st.causal);
      detail::cp::backward_blocks(plan, grads[0], q, gathered[src][0], gathered[src][1], out, lse,
                                  st.scale, dq, dk, dv);
    };
    for (int64_t src = 0; src < cp; ++src) {
      if (src != me) {
        run_block(src, dkv[src][0], dkv[src][1]);
      }
    }
    const at::Tensor local = gathered[me];
    const at::Tensor send = dkv.to(local.scalar_type()).view(flat_shape(local, cp));
    at::Tensor shard = at::empty(local.sizes(), local.options());
    Work work =
        reduce_scatter_tensor_into(shard, send, ReduceOp::Sum, st.mesh.get_group(), overlapped());
    at::Tensor own = at::zeros_like(dkv[me]); // not dkv's slot: `send` may be dkv itself
    run_block(me, own[0], own[1]);
    work.wait();
    return {dq.to(q.scalar_type()), own.add_(shard).to(local.scalar_type()), at::Tensor()};
  }

 private:
  static std::vector<int64_t> by_rank_shape(const at::Tensor& local, int64_t cp) {
    std::vector<int64_t> shape = local.sizes().vec();
    shape.insert(shape.begin(), cp);
    return shape;
  }
  static std::vector<int64_t> flat_shape(const at::Tensor& local, int64_t cp) {
    std::vector<int64_t> shape = local.sizes().vec();
    shape[0] *= cp;
    return shape;
  }
  static CollectiveOptions overlapped() { // sizes agree by construction
    return CollectiveOptions().async_op(true).agree_sizes(false);
  }
};

// [Note: only the rows a rank needs]
// Under a document mask most of another rank's keys are in documents none of this rank's
// queries belong to. The all-gather method then moves by need: source rank s sends rank r
// the rows of its K/V that some block of r's plan against s reads (plan_blocks: a block
// covers only (query, key) pairs the mask leaves, so every row it reads is needed and no
// other is), all pairs in one all-to-all with split sizes; r places them in a zero-filled
// buffer of the whole sequence, where the blocks read them as from the all-gather's. The
// batch rows share the rows sent (a row some batch row needs goes for all). Backward sends
// each source the gradients of the rows it sent, in the reverse all-to-all, and the source
// adds them in rank order in fp32 (its own rows' in their place), as the reduce-scatter it
// replaces adds them. Every rank computes the split sizes from the layout alone, so they
// agree by construction. Per call: forward one all-to-all, backward one, each moving what the
// mask needs (PyTorch's all-gather moves every row).
struct NeededRows : torch::CustomClassHolder {
  std::vector<at::Tensor> to;   // to[r]: this rank's local rows rank r needs (int64)
  std::vector<at::Tensor> from; // from[s]: rank s's local rows this rank needs
  std::vector<int64_t> to_sizes, from_sizes;
};

// The local rows of `src` that some block of `rank`'s plan against it reads.
at::Tensor rows_needed(const CpLayout& layout, int64_t rank, int64_t src, int64_t batch,
                       bool causal) {
  std::vector<char> needed(static_cast<size_t>(layout.local_len()), 0);
  for (const detail::cp::Block& b : plan_blocks(layout, rank, src, batch, causal).blocks) {
    std::fill_n(needed.begin() + b.kv_begin, b.kv_len, char{1});
  }
  std::vector<int64_t> rows;
  for (size_t i = 0; i < needed.size(); ++i) {
    if (needed[i] != 0) {
      rows.push_back(static_cast<int64_t>(i));
    }
  }
  return at::tensor(rows, at::kLong);
}

c10::intrusive_ptr<NeededRows> needed_rows(const CallState& st, int64_t batch) {
  auto n = c10::make_intrusive<NeededRows>();
  for (int64_t r = 0; r < st.layout.cp(); ++r) {
    const bool other = r != st.rank();
    n->to.push_back(other ? rows_needed(st.layout, r, st.rank(), batch, st.causal)
                          : at::empty({0}, at::kLong));
    n->from.push_back(other ? rows_needed(st.layout, st.rank(), r, batch, st.causal)
                            : at::empty({0}, at::kLong));
    n->to_sizes.push_back(n->to.back().numel());
    n->from_sizes.push_back(n->from.back().numel());
  }
  return n;
}

// The rows index[i] + i * stride of `t` along dim 3, one entry after another, as one
// [rows, 2, B, H, d] tensor (what an all-to-all sends, rank by rank).
at::Tensor rows_out(const at::Tensor& t, const std::vector<at::Tensor>& index, int64_t stride) {
  std::vector<at::Tensor> pieces;
  for (size_t i = 0; i < index.size(); ++i) {
    const at::Tensor rows = index[i].to(t.device()) + static_cast<int64_t>(i) * stride;
    pieces.push_back(t.index_select(3, rows).movedim(3, 0));
  }
  return at::cat(pieces).contiguous();
}

struct NeededKvFn : torch::autograd::Function<NeededKvFn> {
  // kv [2, B, Hkv, L, d] -> [2, B, Hkv, cp * L, d], rank-major, zero where not needed.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& kv,
                            c10::intrusive_ptr<CallState> state) {
    const CallState& st = *state;
    auto need = needed_rows(st, kv.size(1));
    const int64_t len = st.layout.local_len(), me = st.rank();
    const at::Tensor received =
        all_to_all_single(rows_out(kv, need->to, 0), need->from_sizes, need->to_sizes,
                          st.mesh.get_group(), CollectiveOptions().agree_sizes(false));
    std::vector<int64_t> shape = kv.sizes().vec();
    shape[3] = st.layout.seq_len();
    at::Tensor full = at::zeros(shape, kv.options());
    full.narrow(3, me * len, len).copy_(kv);
    int64_t at_row = 0;
    for (int64_t s = 0; s < st.layout.cp(); ++s) {
      const int64_t n = need->from_sizes[static_cast<size_t>(s)];
      if (n > 0) {
        full.index_copy_(3, need->from[static_cast<size_t>(s)].to(kv.device()) + s * len,
                         received.narrow(0, at_row, n).movedim(0, 3));
      }
      at_row += n;
    }
    save_state(ctx, std::move(state));
    ctx->saved_data["need"] = c10::IValue::make_capsule(std::move(need));
    return full;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const CallState& st = saved_state(ctx);
    const auto& need =
        *c10::static_intrusive_pointer_cast<NeededRows>(ctx->saved_data["need"].toCapsule());
    const at::Tensor& grad = grads[0];
    const int64_t len = st.layout.local_len(), me = st.rank();
    const at::Tensor back =
        all_to_all_single(rows_out(grad, need.from, len), need.to_sizes, need.from_sizes,
                          st.mesh.get_group(), CollectiveOptions().agree_sizes(false));
    std::vector<int64_t> shape = grad.sizes().vec();
    shape[3] = len;
    at::Tensor dkv = at::zeros(shape, grad.options().dtype(at::kFloat));
    int64_t at_row = 0;
    for (int64_t r = 0; r < st.layout.cp(); ++r) { // rank order, as the reduce-scatter adds
      if (r == me) {
        dkv.add_(grad.narrow(3, me * len, len));
        continue;
      }
      const int64_t n = need.to_sizes[static_cast<size_t>(r)];
      if (n > 0) {
        dkv.index_add_(3, need.to[static_cast<size_t>(r)].to(grad.device()),
                       back.narrow(0, at_row, n).movedim(0, 3));
      }
      at_row += n;
    }
    return {dkv.to(grad.scalar_type()), at::Tensor()};
  }
};

// The ring's transfer of one step: `out` goes to the next rank, `in` arrives from the previous.
struct Exchange {
  std::vector<Work> works;
  void post(const at::Tensor& out, at::Tensor& in, const Group& group, int tag) {
    const int n = group.size(), r = group.rank();
    const auto async = CollectiveOptions().async_op(true);
    works.push_back(recv(in, (r + n - 1) % n, group, tag, async));
    works.push_back(send(out, (r + 1) % n, group, tag, async));
  }
  void wait() {
    for (Work& w : works) {
      w.wait();
    }
    works.clear();
  }
};

// Runs f(src, k, v) for every source rank's K/V as the ring brings them (this rank's first),
// the next block's transfer in flight meanwhile.
template <typename F>
void around_the_ring(const at::Tensor& kv_local, const CallState& st, int tag_base, F&& f) {
  const int64_t cp = st.layout.cp();
  const Group group = st.mesh.get_group();
  at::Tensor cur = kv_local;
  for (int64_t i = 0; i < cp; ++i) {
    Exchange ex;
    at::Tensor next;
    if (i + 1 < cp) {
      next = at::empty_like(cur);
      ex.post(cur, next, group, tag_base + static_cast<int>(i));
      note_kv_bytes(2 * bytes_of(cur));
    }
    f((st.rank() - i + cp) % cp, i, cur[0], cur[1]);
    ex.wait();
    cur = next;
  }
}

struct RingFn : torch::autograd::Function<RingFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, c10::intrusive_ptr<CallState> state) {
    const CallState& st = *state;
    Accumulator acc(q);
    at::Tensor kv = at::stack({k, v}).contiguous();
    note_kv_bytes(bytes_of(kv));
    around_the_ring(kv, st, kKvTag,
                    [&](int64_t src, int64_t, const at::Tensor& ks, const at::Tensor& vs) {
                      Plan plan = plan_blocks(st.layout, st.rank(), src, q.size(0), st.causal);
                      detail::cp::forward_blocks(acc, plan, q, ks, vs, st.scale);
                    });
    return finish_forward(ctx, acc, q, {q, k, v}, std::move(state));
  }

  // dK/dV of source src = rank - i: step 0's stays home; from step 1 a buffer per source
  // travels r+1 -> r+2 -> ... gathering each rank's share, and its last holder sends it home.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const CallState& st = saved_state(ctx);
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const int64_t cp = st.layout.cp();
    const Group group = st.mesh.get_group();
    at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    at::Tensor kv = at::stack({k, v}).contiguous();
    at::Tensor home = at::zeros(kv.sizes(), kv.options().dtype(at::kFloat));
    Exchange travel; // the share sent on at the previous step, and the one arriving
    at::Tensor sent, arriving;
    around_the_ring(kv, st, kKvTag + 0x8000,
                    [&](int64_t src, int64_t i, const at::Tensor& ks, const at::Tensor& vs) {
                      at::Tensor mine = i == 0 ? home : at::zeros_like(home);
                      at::Tensor dk = mine[0], dv = mine[1];
                      Plan plan = plan_blocks(st.layout, st.rank(), src, q.size(0), st.causal);
                      detail::cp::backward_blocks(plan, grads[0], q, ks, vs, out, lse, st.scale, dq,
                                                  dk, dv);
                      if (i == 0) {
                        return;
                      }
                      travel.wait();
                      if (i >= 2) {
                        mine.add_(arriving);
                      }
                      sent = mine;
                      arriving = at::empty_like(home);
                      travel.post(sent, arriving, group, kGradTag + static_cast<int>(i));
                    });
    travel.wait();
    if (cp > 1) {
      home.add_(arriving); // this rank's own dK/dV, from its last holder
    }
    at::Tensor dkv = home.to(k.scalar_type());
    return {dq.to(q.scalar_type()), dkv[0], dkv[1], at::Tensor()};
  }
};

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const DeviceMesh& mesh, const CpLayout& layout) {
  const char* what = "context_parallel_attention";
  DTENSOR_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                "{}: q, k and v must be [batch, heads, seq, head_dim], got {}, {} and {}", what,
                q.sizes(), k.sizes(), v.sizes());
  DTENSOR_CHECK(!is_dtensor(q) && !is_dtensor(k) && !is_dtensor(v),
                "{}: q, k and v must be local tensors (the ContextParallel style takes DTensors' "
                "local heads)",
                what);
  DTENSOR_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(3) == k.size(3) &&
                    q.size(1) % k.size(1) == 0,
                "{}: q {} and k / v {} / {} do not fit (the same batch and head_dim, q's heads a "
                "multiple of k / v's)",
                what, q.sizes(), k.sizes(), v.sizes());
  DTENSOR_CHECK(q.size(2) == layout.local_len() && k.size(2) == layout.local_len(),
                "{}: q has {} and k / v {} sequence rows, but {} gives each rank {}", what,
                q.size(2), k.size(2), layout.describe(), layout.local_len());
  DTENSOR_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
                "{}: q, k and v have dtypes {}, {} and {}", what, c10::toString(q.scalar_type()),
                c10::toString(k.scalar_type()), c10::toString(v.scalar_type()));
  // The simulated device runs the CPU kernels' meta versions (lib/sim/meta_kernels.cpp).
  DTENSOR_CHECK(q.device().is_cpu() || q.device().type() == detail::kSimulatedDevice,
                "{}: the attention kernels are wired for CPU tensors only (got {}): the CUDA "
                "kernels are not built yet (docs/context_parallel.md, \"Not yet\")",
                what, q.device().str());
  DTENSOR_CHECK(mesh.ndim() == 1 && mesh.size() == layout.cp(),
                "{}: the cp mesh must be 1-D with {} ranks ({}), got {}", what, layout.cp(),
                layout.describe(), mesh.to_string());
}

} // namespace

namespace detail::cp {

std::vector<at::Tensor> gathered_attention(const at::Tensor& q, const at::Tensor& kv,
                                           c10::intrusive_ptr<CallState> state) {
  return AllGatherFn::apply(q, kv, std::move(state));
}

std::vector<at::Tensor> ring_attention(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, c10::intrusive_ptr<CallState> state) {
  return RingFn::apply(q, k, v, std::move(state));
}

} // namespace detail::cp

CpStats cp_stats() {
  return detail::cp::stats();
}

void reset_cp_stats() {
  detail::cp::stats() = CpStats{};
}

at::Tensor context_parallel_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const DeviceMesh& cp_mesh, const CpLayout& layout,
                                      const ContextParallelOptions& options, at::Tensor* lse) {
  check_inputs(q, k, v, cp_mesh, layout);
  if (options.method() == CpMethod::Ulysses || options.method() == CpMethod::Hierarchical) {
    ++detail::cp::stats().calls;
    const double scale = detail::cp::softmax_scale(q, options.scale());
    return options.method() == CpMethod::Ulysses
               ? detail::cp::ulysses(q, k, v, cp_mesh, layout, options, scale, lse)
               : detail::cp::hierarchical(q, k, v, cp_mesh, layout, options, scale, lse);
  }
  ++detail::cp::stats().calls;
  auto state = c10::make_intrusive<CallState>(layout, cp_mesh, options.causal(),
                                              detail::cp::softmax_scale(q, options.scale()));
  variable_list r;
  if (options.method() == CpMethod::Ring) {
    r = RingFn::apply(q, k, v, std::move(state));
  } else {
    at::Tensor kv = at::stack({k, v}); // [2, B, Hkv, L, d]
    if (!layout.documents().empty()) { // [Note: only the rows a rank needs]
      const at::Tensor gathered = NeededKvFn::apply(kv, state);
      r = AllGatherFn::apply(q, gathered, std::move(state));
    } else { // [Note: the all-gather beside the own block]
      r = GatheredKvFn::apply(q, kv, std::move(state));
    }
  }
  if (lse != nullptr) {
    *lse = r[1];
  }
  return r[0];
}

} // namespace dtensor
