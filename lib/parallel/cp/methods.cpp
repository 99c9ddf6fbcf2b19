// context_parallel_attention: the all-gather and ring methods over the block engine.
#include <dtensor/collectives.h>
#include <dtensor/context_parallel.h>
#include <dtensor/dtensor.h>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include "internal/check.h"
#include "mesh/dispatch_keys.h"
#include "parallel/cp/blocks.h"

namespace dtensor {

// [Note: two methods]
// Both compute, for this rank's query rows, attention over every rank's key rows, block by
// block ([Note: the block plan] in blocks.cpp), merging the blocks' outputs by their
// log-sum-exp in fp32; they differ in how the keys and values get there.
//  - All-gather: K and V, stacked into one tensor, are a Shard DTensor on the cp mesh,
//    redistributed to Replicate (one all-gather) and taken local with Partial gradients, so
//    that backward, where each rank's dK/dV is only its own queries' share, sums them on their
//    way back: Partial -> Shard, one reduce-scatter, through dtensor's own redistribution. The
//    whole sequence's K/V is saved for backward: O(S) per rank. Per call: forward one
//    all-gather, backward one reduce-scatter (PyTorch's SDPA path: forward one all-gather,
//    backward one all-gather and cp all-to-alls; its flex path two and two).
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
using detail::cp::Plan;
using detail::cp::plan_blocks;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Tags of the ring's transfers (between the same two ranks of the cp group, K/V and dK/dV may
// be in flight at once).
constexpr int kKvTag = 0x43500000;
constexpr int kGradTag = 0x43510000;

struct CallState : torch::CustomClassHolder {
  CallState(CpLayout l, DeviceMesh m, bool c, double s)
      : layout(std::move(l)), mesh(std::move(m)), causal(c), scale(s) {}
  CpLayout layout;
  DeviceMesh mesh;
  bool causal;
  double scale;
  int64_t rank() const { return mesh.get_local_rank(0); }
};

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
  ++detail::cp::stats().calls;
  auto state = c10::make_intrusive<CallState>(layout, cp_mesh, options.causal(),
                                              detail::cp::softmax_scale(q, options.scale()));
  variable_list r;
  if (options.method() == CpMethod::Ring) {
    r = RingFn::apply(q, k, v, std::move(state));
  } else {
    at::Tensor kv = at::stack({k, v}); // [2, B, Hkv, L, d]
    std::vector<int64_t> shape = kv.sizes().vec();
    shape[3] = layout.seq_len();
    at::Tensor gathered = DTensor::from_local(kv, cp_mesh, {Placement::shard(3)}, shape)
                              .redistribute(cp_mesh, {Placement::replicate()})
                              .to_local(Placements{Placement::partial()});
    r = AllGatherFn::apply(q, gathered, std::move(state));
  }
  if (lse != nullptr) {
    *lse = r[1];
  }
  return r[0];
}

} // namespace dtensor
