#pragma once

// The module seam (docs/architecture.md, "The module seam"): hooks around a module call, the
// C++ counterpart of nn.Module.__call__ with its forward pre-hooks, forward hooks and backward
// pre-hooks. LibTorch modules have none, so a model calls its submodules through
//
//   at::Tensor h = dtensor::call(block, x, freqs_cis);   // module(x, freqs_cis)
//
// and every subsystem that acts at module boundaries registers its hooks on the modules it
// manages, from outside the model: fully_shard (casts), tensor parallelism (input and output
// layouts), activation checkpointing (the forward run under a checkpoint), CommDebugMode
// (module attribution, on every module). A module without hooks costs one registry lookup.
// A module called as module->forward(...) runs no hooks: dtensor's op interception then
// stands in where it can ([Note: the fallback trigger] in docs/architecture.md).
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

namespace dtensor {

// The tensors of a call: its tensor arguments in order (an at::Tensor is one, a
// std::vector<at::Tensor> its elements, a std::optional<at::Tensor> one when set), or the
// tensors of what forward returned (a tensor, a vector of them, a tuple of those). Other
// arguments and results are not hooks' business and pass through.
using TensorList = std::vector<at::Tensor>;
using ForwardFn = std::function<TensorList(const TensorList& inputs)>;

// Hook signatures. A pre-forward hook may replace inputs (same count), a post-forward hook
// outputs; an around hook runs `forward` (everything inside it, see below) as it likes, e.g.
// under a checkpoint, where it runs again in backward.
using PreForwardHook = std::function<void(torch::nn::Module& module, TensorList& inputs)>;
using PostForwardHook = std::function<void(torch::nn::Module& module, TensorList& outputs)>;
using PreBackwardHook = std::function<void(torch::nn::Module& module)>;
using AroundForwardHook = std::function<TensorList(torch::nn::Module& module,
                                                   const TensorList& inputs,
                                                   const ForwardFn& forward)>;
using ForwardFailedHook = std::function<void(torch::nn::Module& module)>;

// Where a subsystem's hooks sit. [Note: hook order] A call runs its hooks as nested scopes,
// outermost first: pre-forward hooks in increasing order, post-forward hooks in decreasing
// order (the first to see the inputs is the last to see the outputs), an around hook
// wrapping every hook of a greater order and the forward itself. Equal orders keep
// registration order. Hooks registered for every module (global ones) sit before a module's
// own at the same order.
namespace hook_order {
constexpr int kAttribution = 0;      // CommDebugMode: the module is current for its hooks' comms
constexpr int kFullyShard = 100;     // FSDP2's casts around the unit
constexpr int kCheckpoint = 150;     // activation checkpointing: recomputes what is inside
constexpr int kTensorParallel = 200; // input / output layouts, inside the checkpoint
constexpr int kExpertParallel = 220; // token dispatch and combine around experts, inside TP's layouts
constexpr int kContextParallel = 250; // attention over a sharded sequence, inside TP's layouts
constexpr int kUser = 1000;          // the default
} // namespace hook_order

struct ModuleHooks {
  TORCH_ARG(std::string, name); // who registered them: named in listings and errors
  TORCH_ARG(int, order) = hook_order::kUser;
  TORCH_ARG(PreForwardHook, pre_forward) = nullptr;
  TORCH_ARG(PostForwardHook, post_forward) = nullptr;
  // Once per call that produced outputs requiring grad, when the first of their gradients
  // arrives in backward (FSDP2's pre-backward, PyTorch's full backward pre-hook).
  TORCH_ARG(PreBackwardHook, pre_backward) = nullptr;
  TORCH_ARG(AroundForwardHook, around_forward) = nullptr;
  // Consulted when a call starts: false, the hooks sit this call out (CommDebugMode's, while
  // none is active). Unset: always.
  TORCH_ARG(std::function<bool()>, active) = nullptr;
  // The forward, or a hook inside this one, threw after this one's pre-forward ran (PyTorch's
  // always_call): undo what pre_forward began. The error then goes on to the caller.
  TORCH_ARG(ForwardFailedHook, forward_failed) = nullptr;
};

// Removes what it was returned for (idempotent; PyTorch's RemovableHandle).
class HookHandle {
 public:
  HookHandle() = default;
  explicit HookHandle(std::function<void()> remove) : remove_(std::move(remove)) {}
  void remove();

 private:
  std::function<void()> remove_;
};

// Hooks for calls of `module` (owned by a shared_ptr: a TORCH_MODULE holder, make_shared, or
// a registered submodule). Kept while the module lives; a new module at a freed module's
// address does not inherit them.
HookHandle register_module_hooks(torch::nn::Module& module, ModuleHooks hooks);
// Hooks for calls of every module.
HookHandle register_global_module_hooks(ModuleHooks hooks);
// The names of the hooks a call of `module` runs, in order (global ones included).
std::vector<std::string> module_hook_names(const torch::nn::Module& module);

namespace detail {

struct ModuleCall;

// The hooks of one call, taken when the call starts; null when `module` has none.
std::shared_ptr<const ModuleCall> hooks_for_call(const torch::nn::Module& module);
// Runs the call's hooks around `forward` (which rebuilds the arguments and calls forward).
TensorList run_module_call(const std::shared_ptr<const ModuleCall>& call,
                           const std::shared_ptr<torch::nn::Module>& module, TensorList inputs,
                           ForwardFn forward);
std::shared_ptr<torch::nn::Module> module_owner(torch::nn::Module& module);
// An around-forward hook that did not run forward returned `got` tensors for a forward that
// returns `want` (-1: a type only forward's own value can be rebuilt from): throws unless equal.
void check_hook_outputs(const torch::nn::Module& module, size_t got, int want);

template <typename T>
struct is_tuple : std::false_type {};
template <typename... E>
struct is_tuple<std::tuple<E...>> : std::true_type {};

// How many tensors a value holds (see TensorList).
template <typename T>
size_t tensor_count(const T& v) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    return 1;
  } else if constexpr (std::is_same_v<D, std::vector<at::Tensor>>) {
    return v.size();
  } else if constexpr (std::is_same_v<D, std::optional<at::Tensor>>) {
    return v.has_value() ? 1 : 0;
  } else if constexpr (is_tuple<D>::value) {
    return std::apply([](const auto&... e) { return (size_t{0} + ... + tensor_count(e)); }, v);
  } else {
    return 0;
  }
}

template <typename T>
void flatten_into(TensorList& out, const T& v) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    out.push_back(v);
  } else if constexpr (std::is_same_v<D, std::vector<at::Tensor>>) {
    out.insert(out.end(), v.begin(), v.end());
  } else if constexpr (std::is_same_v<D, std::optional<at::Tensor>>) {
    if (v.has_value()) {
      out.push_back(*v);
    }
  } else if constexpr (is_tuple<D>::value) {
    std::apply([&](const auto&... e) { (flatten_into(out, e), ...); }, v);
  }
}

// `v` with its tensors replaced by flat[at ...]; `at` moves past them.
template <typename T>
T rebuild(const T& v, const TensorList& flat, size_t& at) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return flat[at++];
  } else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) {
    T out(flat.begin() + static_cast<std::ptrdiff_t>(at),
          flat.begin() + static_cast<std::ptrdiff_t>(at + v.size()));
    at += v.size();
    return out;
  } else if constexpr (std::is_same_v<T, std::optional<at::Tensor>>) {
    return v.has_value() ? T(flat[at++]) : T();
  } else if constexpr (is_tuple<T>::value) {
    // A braced list evaluates left to right, so the elements take their tensors in order.
    return std::apply([&](const auto&... e) { return T{rebuild(e, flat, at)...}; }, v);
  } else {
    return v;
  }
}

template <typename M>
auto& impl_of(M& module) {
  if constexpr (std::is_base_of_v<torch::nn::Module, M>) {
    return module;
  } else {
    return *module.get();
  }
}

} // namespace detail

// module(args...): runs `module`'s hooks (see the top of this file) around
// module->forward(args...) and returns what forward returned, with its tensors as the hooks
// left them. `module` is a TORCH_MODULE holder, a shared_ptr to a module, or a module
// (`*this` for a submodule's parent is not needed: pass the submodule). Non-tensor arguments
// are copied when a hook runs forward later (activation checkpointing's recompute).
template <typename M, typename... Args>
auto call(M& module, Args&&... args) {
  auto& impl = detail::impl_of(module);
  std::shared_ptr<const detail::ModuleCall> hooks = detail::hooks_for_call(impl);
  if (!hooks) {
    return impl.forward(std::forward<Args>(args)...);
  }
  using Out = std::decay_t<decltype(impl.forward(std::forward<Args>(args)...))>;
  using Impl = std::remove_reference_t<decltype(impl)>;
  // [Note: the call's state holds no output] `forward` may outlive the call: activation
  // checkpointing keeps it in its autograd node to recompute in backward. The output it
  // records is moved out before the call returns and no later run records one: an output
  // held there would hold the node (its grad_fn), the node `forward`, a cycle that leaked
  // every checkpointed call's saved inputs.
  struct State {
    std::tuple<std::decay_t<Args>...> args;
    std::optional<Out> out;
    std::array<size_t, sizeof...(Args)> offsets;
    bool returned = false;
  };
  auto state = std::make_shared<State>(State{{args...}, std::nullopt, {}, false});
  TensorList inputs;
  size_t arg = 0;
  std::apply(
      [&](const auto&... a) {
        ((state->offsets[arg++] = inputs.size(), detail::flatten_into(inputs, a)), ...);
      },
      state->args);
  std::shared_ptr<torch::nn::Module> owner = detail::module_owner(impl);
  ForwardFn forward = [state, owner](const TensorList& in) {
    Impl& m = static_cast<Impl&>(*owner);
    // Each argument takes its tensors from its own offset: a call's arguments are evaluated
    // in no set order.
    Out out = [&]<size_t... I>(std::index_sequence<I...>) {
      std::array<size_t, sizeof...(Args)> at = state->offsets;
      return Out(m.forward(detail::rebuild(std::get<I>(state->args), in, at[I])...));
    }(std::index_sequence_for<Args...>{});
    TensorList flat;
    detail::flatten_into(flat, out);
    if (!state->out && !state->returned) {
      state->out.emplace(std::move(out));
    }
    return flat;
  };
  TensorList outputs = detail::run_module_call(hooks, owner, std::move(inputs), std::move(forward));
  state->returned = true;
  if (!state->out) {
    // An around-forward hook computed the result without running forward (context
    // parallelism's attention): forward's return type must then be one a tensor list fills.
    if constexpr (std::is_same_v<Out, at::Tensor>) {
      detail::check_hook_outputs(impl, outputs.size(), 1);
      return outputs[0];
    } else if constexpr (std::is_same_v<Out, std::vector<at::Tensor>>) {
      return outputs;
    } else {
      detail::check_hook_outputs(impl, outputs.size(), -1);
    }
  }
  size_t at = 0;
  Out out = std::move(*state->out);
  state->out.reset();
  return detail::rebuild(out, outputs, at);
}

} // namespace dtensor
