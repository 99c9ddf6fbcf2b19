// Post-accumulate-grad hooks for C++ (include/dtensor/grad_hooks.h).
#include <dtensor/grad_hooks.h>

#include <memory>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "internal/check.h"
#include "parallel/grad_hooks_internal.h"

namespace dtensor {

namespace {

// [Note: post-accumulate-grad hooks in C++] LibTorch keeps one PostAccumulateGradHook per
// tensor (Python fills it with a dict of its hooks) and its AccumulateGrad node calls it
// after accumulating. This is the C++ list in that slot; fully_shard, whose own
// accumulator writes .grad later (after the reduce-scatter), calls the same slot there.
struct HookList final : torch::autograd::PostAccumulateGradHook {
  std::vector<dtensor::PostAccumulateGradHook> hooks;
  void operator()(const torch::autograd::Variable& tensor) override {
    for (const auto& h : hooks) {
      h(tensor);
    }
  }
};

} // namespace

void register_post_accumulate_grad_hook(const at::Tensor& param, PostAccumulateGradHook hook) {
  DTENSOR_CHECK(param.defined() && param.is_leaf() && param.requires_grad(),
                "register_post_accumulate_grad_hook: the tensor must be a leaf that requires "
                "grad (defined {}, leaf {}, requires_grad {})",
                param.defined(), param.defined() && param.is_leaf(),
                param.defined() && param.requires_grad());
  DTENSOR_CHECK(hook != nullptr, "register_post_accumulate_grad_hook: no function");
  auto& slot = torch::autograd::impl::post_acc_grad_hooks(param);
  if (!slot) {
    slot = std::make_unique<HookList>();
  }
  auto* list = dynamic_cast<HookList*>(slot.get());
  DTENSOR_CHECK(list != nullptr,
                "register_post_accumulate_grad_hook: the tensor already has a hook of another "
                "kind (a Python one?) in LibTorch's single slot");
  list->hooks.push_back(std::move(hook));
}

namespace detail {

void run_post_accumulate_grad_hooks(const at::Tensor& param) {
  auto& slot = torch::autograd::impl::post_acc_grad_hooks(param);
  if (slot) {
    (*slot)(param);
  }
}

} // namespace detail

} // namespace dtensor
