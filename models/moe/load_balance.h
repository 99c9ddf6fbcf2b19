#pragma once

// The auxiliary-loss-free load balancing of DeepSeek-V3 (arXiv 2408.15664), as torchtitan's
// optimizer step pre-hook _update_expert_bias: per MoE layer, the rows each expert received
// since the last update (tokens_per_expert, summed over every rank that sees other tokens)
// move the expert's bias by coeff * sign(mean - count), mean-centred; the bias changes which
// experts are chosen, not the scores. docs/moe.md, "Load balancing".
//
// [Note: the bias update off the critical path] torchtitan all-reduces the counts in the
// step's pre-hook and waits at once (blocking the step, a TODO there). Here start() issues
// the one all-reduce of every layer's counts ([L, E] fp32) asynchronously and returns; the
// optimizer step runs while it is in flight; finish() waits and applies, before the next
// forward. The values are torchtitan's.
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/nn/module.h>

#include <dtensor/collectives.h>
#include <dtensor/process_group.h>

#include <models/check.h>
#include <models/moe/moe.h>

namespace dtensor::models {

class ExpertBiasUpdate {
 public:
  // Every MoE layer of `model` with a bias, in module order.
  explicit ExpertBiasUpdate(torch::nn::Module& model) {
    for (const auto& m : model.modules(/*include_self=*/true)) {
      if (auto* moe = m->as<MoEImpl>(); moe != nullptr && moe->expert_bias.defined()) {
        layers_.push_back(moe);
      }
    }
  }
  size_t layers() const { return layers_.size(); }
  // The counts of every layer since the last update, summed over `group` (none: this rank's
  // alone) with one asynchronous all-reduce; the layers' counts restart from zero.
  void start(const std::optional<Group>& group) {
    finish();
    if (layers_.empty()) {
      return;
    }
    std::vector<at::Tensor> rows;
    for (MoEImpl* m : layers_) {
      rows.push_back(m->tokens_per_expert.defined() ? m->tokens_per_expert
                                                    : at::zeros_like(m->expert_bias));
    }
    counts_ = at::stack(rows);
    for (MoEImpl* m : layers_) {
      m->tokens_per_expert = at::Tensor();
    }
    if (group && group->size() > 1) {
      work_ =
          dtensor::all_reduce_(counts_, ReduceOp::Sum, *group, CollectiveOptions().async_op(true));
    }
  }
  // Waits for the counts and moves each layer's bias. Nothing to do when nothing was started.
  void finish() {
    if (!counts_.defined()) {
      return;
    }
    work_.wait();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < layers_.size(); ++i) {
      MoEImpl* m = layers_[i];
      at::Tensor c = counts_[static_cast<int64_t>(i)];
      at::Tensor delta = *m->args.load_balance_coeff() * at::sign(c.mean() - c);
      m->expert_bias.add_(delta - delta.mean());
    }
    counts_ = at::Tensor();
  }
  // The counts of the last start(), summed (until finish()): for metrics and tests.
  const at::Tensor& pending_counts() const { return counts_; }

 private:
  std::vector<MoEImpl*> layers_;
  at::Tensor counts_;
  dtensor::Work work_;
};

} // namespace dtensor::models
