// Expert parallelism's float8 dispatch (float8_dispatch.h).
#include "parallel/ep/float8_dispatch.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/Work.hpp> // dtensor::Work held in the state

#include <dtensor/collectives.h>

#include "mesh/collectives_internal.h"
#include "parallel/float8/float8_cast.h"

namespace dtensor::detail::ep {

// [Note: float8 dispatch]
// The dispatch moves each token's hidden state to its experts' rank; in bf16 that is 2 D bytes
// a row. Cast first, it is D + 4: each row's amax gives a scale 448 / amax rounded down to a
// power of two (torchao's rowwise recipe, [Note: float8 scales as torchao computes them]), the
// row times its scale saturates to e4m3, and the scale's fp32 bytes ride after the row's D
// bytes. On arrival the row is the float8 values over the scale in x's dtype: exact
// arithmetic, a power of two, so the experts see what torchao's cast-and-back gives. The
// backward sends the gradient in x's dtype (the cast is treated as the identity, as torchao's
// float8 casts are), and the combine stays in the activation dtype: its rows are the experts'
// outputs, summed into the token, where float8's error would not average out.

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr auto kFloat8 = at::kFloat8_e4m3fn;

at::Tensor to_wire(const at::Tensor& x) {
  at::Tensor scale = float8_amax_to_scale(at::amax(x.abs(), {1}, /*keepdim=*/true), kFloat8,
                                          /*pow2=*/true);
  return at::cat({float8_cast(x, scale, kFloat8).view(at::kByte), scale.view(at::kByte)}, 1);
}

at::Tensor from_wire(const at::Tensor& bytes, int64_t d, c10::ScalarType dtype) {
  at::Tensor q = bytes.narrow(1, 0, d).contiguous().view(kFloat8);
  at::Tensor scale = bytes.narrow(1, d, 4).contiguous().view(at::kFloat);
  return (q.to(at::kFloat) / scale).to(dtype);
}

struct Float8State : torch::CustomClassHolder {
  std::vector<int64_t> out_splits, in_splits;
  Group group;
  bool with_header = false; // the header input is a placeholder otherwise (autograd's inputs
                            // must be defined tensors)
};

struct Float8AllToAllFn : torch::autograd::Function<Float8AllToAllFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& header,
                               c10::intrusive_ptr<Float8State> state) {
    const int64_t d = x.size(1), w = float8_row_bytes(d);
    at::Tensor bytes = to_wire(x.detach());
    int64_t head_rows = 0, ep = 0;
    const bool with_header = state->with_header;
    if (with_header) {
      ep = header.size(0);
      head_rows = header.size(1);
      bytes = at::cat({header, bytes.view({ep, -1, w})}, 1).flatten(0, 1);
    }
    at::Tensor got =
        dtensor::all_to_all_single(bytes.contiguous(), state->out_splits, state->in_splits,
                                   state->group, detail::known_sizes());
    at::Tensor head = at::empty({0}, got.options());
    if (with_header) {
      at::Tensor blocks = got.view({ep, -1, w});
      head = blocks.narrow(1, 0, head_rows).contiguous();
      got = blocks.narrow(1, head_rows, blocks.size(1) - head_rows).reshape({-1, w});
    }
    ctx->saved_data["a2a"] = c10::IValue::make_capsule(std::move(state));
    ctx->mark_non_differentiable({head});
    return {from_wire(got, d, x.scalar_type()), head};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state =
        c10::static_intrusive_pointer_cast<Float8State>(ctx->saved_data["a2a"].toCapsule());
    if (!grads[0].defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor()};
    }
    // What was received goes back to where it came from, in x's dtype: the splits swapped.
    return {dtensor::all_to_all_single(grads[0].contiguous(), state->in_splits, state->out_splits,
                                       state->group, detail::known_sizes()),
            at::Tensor(), at::Tensor()};
  }
};

} // namespace

// [Note: float8 all-to-all issued apart] The rows travel as bytes, which carry no gradient, so
// the graph from x to the received rows runs through a token: Start quantizes x, issues the
// all-to-all of the bytes and returns an empty tensor of x's dtype; Wait takes the token, waits
// and returns the rows decoded. Wait's backward issues the gradient's all-to-all (x's dtype, the
// splits swapped) and gives the token an empty gradient; Start's backward waits and returns it
// as x's gradient. The same nodes, in the same order, as [Note: overlapped all-to-alls].
struct Float8AsyncState : torch::CustomClassHolder {
  Group group;
  int64_t d = 0, head_rows = 0, x_rows = 0;
  c10::ScalarType dtype = at::kFloat;
  at::Tensor sent, received; // bytes
  Work work;
  at::Tensor grad_output, grad_input; // the backward's
  Work grad_work;
  at::Tensor header; // received, once waited for
};

namespace {

using AsyncState = Float8AsyncState;

c10::intrusive_ptr<AsyncState> async_state_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<AsyncState>(ctx->saved_data["a2a"].toCapsule());
}

struct StartFloat8Fn : torch::autograd::Function<StartFloat8Fn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& header,
                            c10::intrusive_ptr<AsyncState> state) {
    const int64_t w = float8_row_bytes(state->d);
    at::Tensor bytes = to_wire(x.detach());
    if (state->head_rows > 0) {
      const int64_t ep = header.size(0);
      bytes = at::cat({header, bytes.view({ep, -1, w})}, 1).flatten(0, 1);
    }
    state->sent = bytes.contiguous();
    state->received = at::empty_like(state->sent);
    state->work = detail::all_to_all_single_into(state->received, state->sent, {}, {}, state->group,
                                                 CollectiveOptions().async_op(true));
    ctx->saved_data["a2a"] = c10::IValue::make_capsule(std::move(state));
    return at::empty({0}, x.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list) {
    const auto state = async_state_of(ctx);
    state->grad_work.wait(); // issued by Wait's backward
    state->grad_output = at::Tensor();
    at::Tensor g = std::move(state->grad_input);
    return {g, at::Tensor(), at::Tensor()};
  }
};

struct WaitFloat8Fn : torch::autograd::Function<WaitFloat8Fn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& token,
                            c10::intrusive_ptr<AsyncState> state) {
    state->work.wait();
    state->sent = at::Tensor();
    const int64_t w = float8_row_bytes(state->d);
    at::Tensor got = state->received;
    if (state->head_rows > 0) {
      const int64_t ep = state->group.size();
      at::Tensor blocks = got.view({ep, -1, w});
      state->header = blocks.narrow(1, 0, state->head_rows).contiguous();
      got = blocks.narrow(1, state->head_rows, blocks.size(1) - state->head_rows).reshape({-1, w});
    }
    at::Tensor rows = from_wire(got, state->d, state->dtype);
    state->received = at::Tensor();
    ctx->saved_data["a2a"] = c10::IValue::make_capsule(std::move(state));
    return rows;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state = async_state_of(ctx);
    // What was received goes back to where it came from, in x's dtype (equal splits).
    state->grad_output = grads[0].contiguous();
    state->grad_input = at::empty({state->x_rows, state->d}, state->grad_output.options());
    state->grad_work =
        detail::all_to_all_single_into(state->grad_input, state->grad_output, {}, {}, state->group,
                                       CollectiveOptions().async_op(true));
    return {at::empty({0}, state->grad_output.options()), at::Tensor()};
  }
};

} // namespace

PendingFloat8AllToAll::PendingFloat8AllToAll(at::Tensor token,
                                             c10::intrusive_ptr<Float8AsyncState> state)
    : token_(std::move(token)), state_(std::move(state)) {}

Float8Received PendingFloat8AllToAll::wait() {
  at::Tensor rows = WaitFloat8Fn::apply(token_, state_);
  Float8Received r{rows, state_->header};
  token_ = at::Tensor();
  state_.reset();
  return r;
}

PendingFloat8AllToAll start_float8_all_to_all(const at::Tensor& x, const at::Tensor& header,
                                              const Group& group) {
  auto state = c10::make_intrusive<AsyncState>();
  state->group = group;
  state->d = x.size(1);
  state->x_rows = x.size(0);
  state->dtype = x.scalar_type();
  state->head_rows = header.defined() ? header.size(1) : 0;
  at::Tensor token = StartFloat8Fn::apply(
      x, header.defined() ? header : at::empty({0}, x.options().dtype(at::kByte)), state);
  return {std::move(token), std::move(state)};
}

Float8Received float8_all_to_all(const at::Tensor& x, const at::Tensor& header,
                                 const std::vector<int64_t>& out_splits,
                                 const std::vector<int64_t>& in_splits, const Group& group) {
  auto state = c10::make_intrusive<Float8State>();
  state->out_splits = out_splits;
  state->in_splits = in_splits;
  state->group = group;
  state->with_header = header.defined();
  variable_list out = Float8AllToAllFn::apply(
      x, header.defined() ? header : at::empty({0}, x.options().dtype(at::kByte)),
      std::move(state));
  return {out[0], header.defined() ? out[1] : at::Tensor()};
}

} // namespace dtensor::detail::ep
