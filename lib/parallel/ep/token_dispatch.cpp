// Expert parallelism's token exchange: counts, plan, dispatch and combine.
#include "parallel/ep/token_dispatch.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include <dtensor/expert_parallel.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "parallel/ep/float8_dispatch.h"

namespace dtensor::detail::ep {

// [Note: the token exchange]
// Rows arrive grouped by global expert, experts in order; the experts of ep rank j are the
// j-th of ep equal blocks, so the rows for each rank are already contiguous and an
// all-to-all with splits = the rows per rank sends them. First the counts themselves go
// (one all-to-all of E int64s: rank i receives, for each of its E/ep experts, how many rows
// each rank sends), which is what lets every rank size its receive before the rows move:
// torchtitan's order, but issued asynchronously when the router returns (ExpertParallel::
// apply_router), so that the shared experts compute while it is in flight. Received rows come
// source-rank-major ([source][expert]); the experts want expert-major ([expert][source]):
// one index_select with the permutation the counts give (`order`), and its inverse before the
// rows go home. Zero rows anywhere are empty splits and empty groups, no padding, so no rank
// waits for rows that never come and no padded row reaches a kernel (torchtitan#1166, #1237).

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<int64_t> to_vector(const at::Tensor& t) {
  at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

struct AllToAllState : torch::CustomClassHolder {
  std::vector<int64_t> out_splits, in_splits;
  Group group;
};

struct AllToAllFn : torch::autograd::Function<AllToAllFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            c10::intrusive_ptr<AllToAllState> state, bool checked) {
    at::Tensor out =
        checked ? dtensor::all_to_all_single(input.contiguous(), state->out_splits,
                                             state->in_splits, state->group)
                : dtensor::all_to_all_single(input.contiguous(), state->out_splits,
                                             state->in_splits, state->group, detail::known_sizes());
    ctx->saved_data["a2a"] = c10::IValue::make_capsule(std::move(state));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state =
        c10::static_intrusive_pointer_cast<AllToAllState>(ctx->saved_data["a2a"].toCapsule());
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor()};
    }
    // What was received goes back to where it came from: the splits swapped.
    at::Tensor g =
        dtensor::all_to_all_single(grads[0].contiguous(), state->in_splits, state->out_splits,
                                   state->group, detail::known_sizes());
    return {g, at::Tensor(), at::Tensor()};
  }
};

} // namespace

at::Tensor all_to_all_autograd(const at::Tensor& input, const std::vector<int64_t>& out_splits,
                               const std::vector<int64_t>& in_splits, const Group& group,
                               bool checked) {
  auto state = c10::make_intrusive<AllToAllState>();
  state->out_splits = out_splits;
  state->in_splits = in_splits;
  state->group = group;
  return AllToAllFn::apply(input, std::move(state), checked);
}

CountsExchange start_counts_exchange(const at::Tensor& counts, const Group& group, bool async) {
  const int64_t ep = group.size();
  DTENSOR_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong,
                "ExpertParallel: the counts of rows per expert must be a 1-D int64 tensor, got {}",
                describe(counts));
  DTENSOR_CHECK(counts.size(0) % ep == 0,
                "ExpertParallel: {} experts (counts {}) cannot be split over the {} ranks of {}",
                counts.size(0), describe(counts), ep, group.to_string());
  CountsExchange x;
  x.sent = counts.detach().contiguous();
  x.received = at::empty_like(x.sent);
  x.work = detail::all_to_all_single_into(x.received, x.sent, {}, {}, group,
                                          CollectiveOptions().async_op(async));
  x.received = x.received.view({ep, counts.size(0) / ep});
  return x;
}

ExchangePlan plan_exchange(const at::Tensor& counts, const at::Tensor& received) {
  const int64_t ep = received.size(0), local = received.size(1);
  ExchangePlan p;
  p.send_splits = to_vector(counts.view({ep, local}).sum(1));
  p.recv_splits = to_vector(received.sum(1));
  // Received blocks [source][expert]; their starts, then read expert-major.
  at::Tensor sizes = received.to(at::kCPU).flatten();
  at::Tensor starts = sizes.cumsum(0) - sizes;
  at::Tensor by_expert = sizes.view({ep, local}).t().flatten();
  at::Tensor start_by_expert = starts.view({ep, local}).t().flatten();
  const int64_t rows = sizes.sum().item<int64_t>();
  at::Tensor first = by_expert.cumsum(0) - by_expert; // where each block lands, expert-major
  at::Tensor pos = at::arange(rows, sizes.options());
  p.order = at::repeat_interleave(start_by_expert - first, by_expert, std::nullopt,
                                  /*output_size=*/rows) +
            pos;
  p.inverse = at::empty_like(p.order).scatter_(0, p.order, pos);
  p.local_counts = received.sum(0);
  const auto device = counts.device();
  p.order = p.order.to(device);
  p.inverse = p.inverse.to(device);
  return p;
}

at::Tensor dispatch(const at::Tensor& x, const ExchangePlan& plan, bool float8,
                    const Group& group) {
  at::Tensor received =
      float8 ? float8_all_to_all(x, at::Tensor(), plan.recv_splits, plan.send_splits, group).rows
             : all_to_all_autograd(x, plan.recv_splits, plan.send_splits, group, false);
  return received.index_select(0, plan.order);
}

at::Tensor combine(const at::Tensor& y, const ExchangePlan& plan, const Group& group) {
  return all_to_all_autograd(y.index_select(0, plan.inverse), plan.send_splits, plan.recv_splits,
                             group, false);
}

} // namespace dtensor::detail::ep

namespace dtensor {

at::Tensor all_to_all_single_autograd(const at::Tensor& input,
                                      const std::vector<int64_t>& out_splits,
                                      const std::vector<int64_t>& in_splits, const Group& group) {
  return detail::ep::all_to_all_autograd(input, out_splits, in_splits, group, true);
}

} // namespace dtensor
