// dtensor::activation_checkpoint (dtensor/activation_checkpoint.h): a function's activations
// dropped after forward and recomputed in backward.
#include <dtensor/activation_checkpoint.h>

#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <dtensor/random.h>

#include "internal/check.h"
#include "parallel/end_of_backward.h"
#include "tensor/dispatch/op_args.h"
#include "tensor/random/rng_state.h"
#include "train/activation_checkpoint/selective.h"

namespace dtensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [Note: checkpoint as a backward inside backward]
// LibTorch has no saved-tensor hooks for C++ (its default hooks are Python objects), so the
// non-reentrant design of torch.utils.checkpoint, which intercepts what autograd saves, is
// out of reach. The checkpointed function becomes one autograd node instead:
//  - forward runs the function below autograd (a custom Function's forward records
//    nothing), keeping only its inputs, and the random states it started from;
//  - that node's backward runs the function again with autograd on (the recompute), from
//    the same random states, on detached copies of the inputs, then a backward over the
//    recomputed graph with the incoming gradients. Parameters used inside get their
//    gradients there, through their own accumulators (fully_shard's and replicate's
//    included); the inputs' gradients are returned to the outer graph.
// A zero-size tensor that requires grad is always among the node's inputs, so backward
// reaches the node even when no input requires grad (the parameters inside still need
// their gradients; PyTorch's reentrant checkpoint loses them there).
// The recompute runs inside the outer backward: fully_shard sees a backward use of its
// units (unshard, backward prefetch: FSDP2's pre-backward hook), tensor parallelism sees
// forward ([Note: recompute is forward for tensor parallelism] in op_args.h), and
// end-of-backward callbacks queued by the inner backward go to the outer one
// ([Note: nested backward] in lib/parallel/end_of_backward.h).

// The random states a recompute must start from.
struct RandomStates {
  RngState dtensor_state;
  std::vector<std::pair<at::Generator, at::Tensor>> generators;

  static RandomStates capture(const std::vector<at::Tensor>& inputs) {
    RandomStates s;
    s.dtensor_state = get_rng_state();
    std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
    for (const auto& t : inputs) {
      // CUDA's generators (the simulated device, like meta, has none: nothing is drawn).
      if (t.defined() && t.is_cuda() &&
          std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
        devices.push_back(t.device());
      }
    }
    for (const auto& d : devices) {
      at::Generator g = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(g.mutex());
      s.generators.emplace_back(g, g.get_state());
    }
    return s;
  }

  void restore() const {
    set_rng_state(dtensor_state);
    for (const auto& [g, state] : generators) {
      at::Generator gen = g;
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
};

struct CheckpointState : torch::CustomClassHolder {
  CheckpointFn fn;
  ActivationCheckpointOptions options;
  std::optional<RandomStates> random;
  detail::SavedOps saved; // selective checkpointing's saved outputs
  // The batch slice dtensor's random ops drew for in forward ([Note: batch slices] in
  // dtensor/random.h): the recompute draws for it again.
  std::pair<int64_t, int64_t> batch_slice{1, 0};
};

c10::intrusive_ptr<CheckpointState> state_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
}

std::vector<at::Tensor> run(CheckpointState& s, const std::vector<at::Tensor>& inputs,
                            bool recompute) {
  if (!s.options.policy()) {
    return s.fn(inputs);
  }
  if (recompute) {
    detail::SelectiveReplayGuard replay(s.options.policy(), s.saved);
    auto out = s.fn(inputs);
    replay.finish();
    return out;
  }
  detail::SelectiveRecordGuard record(s.options.policy(), s.saved);
  return s.fn(inputs);
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // (`args` as a TensorList: autograd takes each of its tensors as an input; a vector
  // would be one non-tensor argument.)
  static variable_list forward(AutogradContext* ctx, at::TensorList args,
                               const c10::intrusive_ptr<CheckpointState>& state) {
    const std::vector<at::Tensor> inputs(args.begin(), args.end() - 1); // the last: anchor
    if (state->options.preserve_rng_state()) {
      state->random = RandomStates::capture(inputs);
    }
    std::vector<at::Tensor> outputs;
    {
      detail::CheckpointForwardGuard first_forward;
      outputs = run(*state, inputs, /*recompute=*/false);
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      DTENSOR_CHECK(outputs[i].defined(),
                    "activation_checkpoint: output {} of the function is undefined", i);
    }
    ctx->save_for_backward(inputs);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    const c10::intrusive_ptr<CheckpointState> state = state_of(ctx);
    std::vector<at::Tensor> inputs;
    for (const auto& t : ctx->get_saved_variables()) {
      inputs.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
    }
    std::vector<at::Tensor> outputs;
    {
      std::optional<RandomStates> now;
      if (state->random) {
        now = RandomStates::capture(inputs);
        state->random->restore();
      }
      at::AutoGradMode grad(true);
      detail::RecomputeGuard recompute;
      BatchShardGuard batch(state->batch_slice.first, state->batch_slice.second);
      try {
        outputs = run(*state, inputs, /*recompute=*/true);
      } catch (...) {
        if (now) {
          now->restore();
        }
        throw;
      }
      if (now) {
        now->restore();
      }
    }
    DTENSOR_CHECK(outputs.size() == grads.size(),
                  "activation_checkpoint: the recompute gave {} outputs, forward gave {}",
                  outputs.size(), grads.size());
    std::vector<at::Tensor> roots;
    std::vector<at::Tensor> root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) {
      detail::NestedBackwardScope nested;
      torch::autograd::backward(roots, root_grads);
    }
    variable_list out;
    for (const auto& t : inputs) {
      out.push_back(t.defined() && t.requires_grad() ? t.grad() : at::Tensor());
    }
    out.emplace_back(); // the anchor
    out.emplace_back(); // `state`
    return out;
  }
};

} // namespace

std::vector<at::Tensor> activation_checkpoint(const CheckpointFn& fn,
                                              const std::vector<at::Tensor>& inputs,
                                              const ActivationCheckpointOptions& options) {
  DTENSOR_CHECK(fn != nullptr, "activation_checkpoint: no function");
  if (!at::GradMode::is_enabled()) {
    return fn(inputs); // nothing will be differentiated: nothing to save or drop
  }
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = fn;
  state->options = options;
  state->batch_slice = detail::current_batch_slice();
  variable_list args(inputs.begin(), inputs.end());
  // The anchor: [Note: checkpoint as a backward inside backward].
  args.push_back(at::empty({0}).requires_grad_(true));
  return CheckpointFunction::apply(at::TensorList(args), state);
}

at::Tensor activation_checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                                 const at::Tensor& input,
                                 const ActivationCheckpointOptions& options) {
  DTENSOR_CHECK(fn != nullptr, "activation_checkpoint: no function");
  // `fn` by value: the recompute calls it after this returns.
  auto outs = activation_checkpoint(
      [fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
      {input}, options);
  return outs[0];
}

HookHandle checkpoint_module(torch::nn::Module& module, ActivationCheckpointOptions options) {
  return register_module_hooks(
      module, ModuleHooks()
                  .name("activation checkpointing")
                  .order(hook_order::kCheckpoint)
                  .around_forward([options](torch::nn::Module&, const TensorList& inputs,
                                            const ForwardFn& forward) {
                    return activation_checkpoint(forward, inputs, options);
                  }));
}

at::Tensor CheckpointWrapperImpl::forward(const at::Tensor& x) {
  return activation_checkpoint(forward_, x, options_);
}

} // namespace dtensor
