// Expert parallelism's overlapped all-to-all (async_all_to_all.h).
#include "parallel/ep/async_all_to_all.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/Work.hpp> // dtensor::Work held in the state

#include <dtensor/collectives.h>

#include "mesh/collectives_internal.h"

namespace dtensor::detail::ep {

// [Note: overlapped all-to-alls]
// One all-to-all is two autograd nodes: Start issues it (asynchronously) and returns the output
// buffer, Wait waits and returns the buffer as the output proper. Backward mirrors it: Wait's
// backward issues the inverse all-to-all of the output's gradient and returns its buffer,
// Start's backward waits for it. Whatever the caller computes between a Start and its Wait runs
// while the rows travel. Backward interleaves by itself: the engine runs the ready node created
// last first, so the nodes a forward created between another all-to-all's Start and Wait (the
// other chunk's experts) run while that one's gradient is in flight. Every rank issues the same
// all-to-alls in the same order, forward and backward, as the synchronous path does.

struct AsyncAllToAllState : torch::CustomClassHolder {
  std::vector<int64_t> out_splits, in_splits;
  Group group;
  int64_t input_rows = 0;
  at::Tensor input; // read by the forward's all-to-all until it completes
  Work work;
  at::Tensor grad_output; // read by the backward's until it completes
  Work grad_work;
};

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using State = AsyncAllToAllState;

int64_t rows_of(const std::vector<int64_t>& splits, int64_t equal_rows) {
  int64_t n = 0;
  for (int64_t s : splits) {
    n += s;
  }
  return splits.empty() ? equal_rows : n;
}

// Issues `in` -> a new buffer of `rows` rows, asynchronously; `work` completes it.
at::Tensor issue(const at::Tensor& in, int64_t rows, const std::vector<int64_t>& out_splits,
                 const std::vector<int64_t>& in_splits, const Group& group, Work& work) {
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = rows;
  at::Tensor out = at::empty(shape, in.options());
  work = detail::all_to_all_single_into(out, in, out_splits, in_splits, group,
                                        CollectiveOptions().async_op(true));
  return out;
}

c10::intrusive_ptr<State> state_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<State>(ctx->saved_data["a2a"].toCapsule());
}

struct StartFn : torch::autograd::Function<StartFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            c10::intrusive_ptr<State> state) {
    state->input = input.contiguous();
    state->input_rows = input.size(0);
    at::Tensor out = issue(state->input, rows_of(state->out_splits, input.size(0)),
                           state->out_splits, state->in_splits, state->group, state->work);
    ctx->saved_data["a2a"] = c10::IValue::make_capsule(std::move(state));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state = state_of(ctx);
    state->grad_work.wait(); // issued by Wait's backward; grads[0] is its buffer
    state->grad_output = at::Tensor();
    return {grads[0], at::Tensor()};
  }
};

struct WaitFn : torch::autograd::Function<WaitFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& in_flight,
                            c10::intrusive_ptr<State> state) {
    state->work.wait();
    state->input = at::Tensor();
    ctx->saved_data["a2a"] = c10::IValue::make_capsule(std::move(state));
    return in_flight;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state = state_of(ctx);
    // What was received goes back to where it came from: the splits swapped.
    state->grad_output = grads[0].contiguous();
    at::Tensor g = issue(state->grad_output, state->input_rows, state->in_splits, state->out_splits,
                         state->group, state->grad_work);
    return {g, at::Tensor()};
  }
};

} // namespace

PendingAllToAll::PendingAllToAll(at::Tensor in_flight, c10::intrusive_ptr<AsyncAllToAllState> state)
    : in_flight_(std::move(in_flight)), state_(std::move(state)) {}

at::Tensor PendingAllToAll::wait() {
  at::Tensor out = WaitFn::apply(in_flight_, state_);
  in_flight_ = at::Tensor();
  state_.reset();
  return out;
}

PendingAllToAll start_all_to_all(const at::Tensor& input, const std::vector<int64_t>& out_splits,
                                 const std::vector<int64_t>& in_splits, const Group& group) {
  auto state = c10::make_intrusive<State>();
  state->out_splits = out_splits;
  state->in_splits = in_splits;
  state->group = group;
  at::Tensor in_flight = StartFn::apply(input, state);
  return {std::move(in_flight), std::move(state)};
}

} // namespace dtensor::detail::ep
