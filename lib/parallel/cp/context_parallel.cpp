// The ContextParallel style: context_parallel_attention in place of an attention module's
// forward, registered on the module seam.
#include <dtensor/context_parallel.h>
#include <dtensor/dtensor.h>
#include <dtensor/module_hooks.h>

#include <mutex>

#include <torch/nn/module.h>

#include "internal/check.h"

namespace dtensor {

// [Note: context parallelism on the module seam]
// The style owns no global state: its options and the current step's layout live in the
// style object, shared by the hooks of every module it was applied to (PyTorch's
// context_parallel keeps them in module globals and patches F.scaled_dot_product_attention,
// pytorch#164500). Its around-forward hook, at hook_order::kContextParallel (inside tensor
// parallelism's input layouts, so under TP the hook sees q / k / v already as the heads'
// DTensors), never runs the module's own forward: it runs context_parallel_attention on the
// local tensors of the call's three inputs. A DTensor input (TP's Shard on the heads)
// contributes its local heads and the output goes back in q's placements, with no
// communication; the cp mesh is a different mesh dimension from TP's.

struct ContextParallel::State {
  ContextParallelOptions options;
  std::mutex mutex;
  std::optional<CpLayout> layout;
  bool enabled = true;
};

ContextParallel::ContextParallel(ContextParallelOptions options)
    : state_(std::make_shared<State>()) {
  state_->options = std::move(options);
}

const ContextParallelOptions& ContextParallel::options() const {
  return state_->options;
}

void ContextParallel::set_layout(const CpLayout& layout) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->layout = layout;
}

void ContextParallel::set_enabled(bool enabled) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->enabled = enabled;
}

bool ContextParallel::enabled() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->enabled;
}

CpLayout ContextParallel::layout() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  DTENSOR_CHECK(state_->layout.has_value(),
                "ContextParallel: no layout yet (set_layout gives the layout of the step's "
                "sequences over the cp ranks)");
  return *state_->layout;
}

namespace {

at::Tensor local_of(const at::Tensor& t) {
  return is_dtensor(t) ? DTensor(t).to_local() : t;
}

TensorList run_attention(const std::shared_ptr<ContextParallel::State>& state,
                         torch::nn::Module& module, const TensorList& inputs,
                         const DeviceMesh& cp_mesh);

} // namespace

void ContextParallel::apply(torch::nn::Module& module, const DeviceMesh& cp_mesh) const {
  DTENSOR_CHECK(cp_mesh.ndim() == 1, "ContextParallel on '{}': the cp mesh must be 1-D, got {}",
                module.name(), cp_mesh.to_string());
  // The hook holds a copy of the style: the same options and layout (one shared state).
  register_module_hooks(
      module,
      ModuleHooks()
          .name("ContextParallel")
          .order(hook_order::kContextParallel)
          .around_forward([style = *this, cp_mesh](torch::nn::Module& m, const TensorList& inputs,
                                                   const ForwardFn& forward) {
            return style.enabled() ? run_attention(style.state_, m, inputs, cp_mesh)
                                   : forward(inputs);
          }));
}

namespace {

TensorList run_attention(const std::shared_ptr<ContextParallel::State>& state,
                         torch::nn::Module& module, const TensorList& inputs,
                         const DeviceMesh& cp_mesh) {
  bool attention = inputs.size() == 3;
  for (size_t i = 0; attention && i < 3; ++i) {
    attention = inputs[i].dim() == 4;
  }
  DTENSOR_CHECK(inputs.size() != 4,
                "ContextParallel: module '{}' was called with a fourth tensor, an attention mask: "
                "context parallelism takes causal and document masks only, from the layout "
                "(CpLayout's documents and ContextParallelOptions::causal)",
                module.name());
  DTENSOR_CHECK(attention,
                "ContextParallel: module '{}' is not attention: its call has {} tensor inputs, "
                "the style needs three, q, k and v, each [batch, heads, seq, head_dim]",
                module.name(), inputs.size());
  std::optional<CpLayout> layout;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    layout = state->layout;
  }
  DTENSOR_CHECK(layout.has_value(),
                "ContextParallel: module '{}' was called before the style's set_layout (the "
                "layout of the step's sequences over the cp ranks)",
                module.name());
  const at::Tensor& q = inputs[0];
  at::Tensor out = context_parallel_attention(local_of(q), local_of(inputs[1]), local_of(inputs[2]),
                                              cp_mesh, *layout, state->options);
  if (is_dtensor(q)) {
    const DTensor dq(q);
    out = DTensor::from_local(out, dq.device_mesh(), dq.placements(), q.sizes().vec());
  }
  return {out};
}

} // namespace

} // namespace dtensor
