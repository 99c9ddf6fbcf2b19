#pragma once

// torchtitan's pipeline split for the Llama-3 model (pipeline_module_split): one stage of the
// model holds consecutive blocks, the token embeddings on the first stage and the final norm
// and output projection on the last, each module under its name in the whole model
// ("layers.3.attention.wq.weight"), so that state dicts, checkpoints and Hugging Face names do
// not change with the split. Like parallelize.h, applied from outside the model ([Note: models
// carry no parallelism] in models/llama3/model.h); docs/pipeline.md.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <dtensor/module_hooks.h>
#include <dtensor/tensor_parallel.h>

#include <models/check.h>
#include <models/llama3/model.h>
#include <models/llama3/parallelize.h>

namespace dtensor::models {

// The blocks [first, last) of stage `stage` of `num_stages`: an even split, the first
// n_layers % num_stages stages one block more (torchtitan's split by layer, with the
// embeddings and the output counted with their stages' blocks).
inline std::pair<int64_t, int64_t> llama3_stage_layers(int64_t n_layers, int64_t stage,
                                                       int64_t num_stages) {
  DTENSOR_MODEL_CHECK(num_stages >= 1 && num_stages <= n_layers && stage >= 0 && stage < num_stages,
                      "Llama3 pipeline split: stage ", stage, " of ", num_stages, " for ", n_layers,
                      " layers (each stage needs at least one block)");
  const int64_t base = n_layers / num_stages;
  const int64_t extra = n_layers % num_stages;
  const int64_t first = stage * base + std::min(stage, extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

// One stage, sharing the whole model's modules (the model itself can go).
// forward: token ids -> hidden states on the first stage, hidden states -> hidden states in
// between, -> logits on the last (a single stage: the whole model's forward).
struct Llama3StageImpl : torch::nn::Module {
  Llama3StageImpl(const Llama3& model, int64_t stage_index, int64_t stages)
      : model_args(model->model_args), stage(stage_index), num_stages(stages) {
    const auto [first, last] = llama3_stage_layers(model->model_args.n_layers(), stage, stages);
    if (stage == 0) {
      tok_embeddings = register_module("tok_embeddings", model->tok_embeddings);
    }
    freqs_cis = register_buffer("freqs_cis", model->freqs_cis);
    layers = register_module("layers", std::make_shared<torch::nn::Module>("Layers"));
    for (int64_t i = first; i < last; ++i) {
      auto block = model->layers->ptr(static_cast<size_t>(i));
      layers->register_module(std::to_string(i), block);
      blocks.push_back(block->as<Llama3BlockImpl>());
    }
    if (stage == stages - 1) {
      norm = register_module("norm", model->norm);
      output = register_module("output", model->output);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = tok_embeddings ? dtensor::call(tok_embeddings, x) : x;
    for (auto* block : blocks) {
      h = dtensor::call(*block, h, freqs_cis);
    }
    return output ? dtensor::call(output, dtensor::call(norm, h)) : h;
  }

  Llama3Args model_args;
  int64_t stage;
  int64_t num_stages;
  torch::nn::Embedding tok_embeddings{nullptr};
  at::Tensor freqs_cis;
  std::shared_ptr<torch::nn::Module> layers;
  std::vector<Llama3BlockImpl*> blocks; // owned by `layers`
  RMSNorm norm{nullptr};
  torch::nn::Linear output{nullptr};
};
TORCH_MODULE(Llama3Stage);

// llama3_tp_plan without the entries of modules the stage does not hold (the embeddings, the
// output, and in a mixture-of-experts model the dense or the MoE blocks' entries).
inline dtensor::ParallelizePlan llama3_stage_tp_plan(const Llama3StageImpl& stage,
                                                     bool loss_parallel) {
  bool dense = false;
  bool moe = false;
  for (const auto* block : stage.blocks) {
    dense = dense || !block->moe;
    moe = moe || block->moe;
  }
  dtensor::ParallelizePlan plan;
  for (auto& entry : llama3_tp_plan(loss_parallel, stage.model_args)) {
    const std::string& p = entry.pattern;
    const bool held = p == "tok_embeddings"                        ? bool(stage.tok_embeddings)
                      : p == "norm" || p == "output"               ? bool(stage.output)
                      : p.rfind("layers.*.feed_forward", 0) == 0   ? dense
                      : p.rfind("layers.*.moe", 0) == 0            ? moe
                                                                   : true;
    if (held) {
      plan.push_back(std::move(entry));
    }
  }
  return plan;
}

// parallelize_llama3 for one stage (parallelize_llama3_part with the stage's share of the
// plan) on a mesh with dimensions (dp_replicate, dp_shard, tp), and cp with `cp`: the whole
// world mesh (pp, dp_replicate, dp_shard, [cp,] tp) or its slice without pp. Context
// parallelism, activation checkpointing, mixture-of-experts layers (with `ep` and under tp)
// and fully_shard_part's units of the stage, then the stage itself (its root unit, which the
// pipeline schedule drives). torchtitan's choice under pipelining: reshard_after_forward off
// unless `fsdp` sets it (each microbatch's backward would gather the blocks again).
//
// [Note: initializing stages built on meta] A model built on the meta device and split into
// stages is initialized by the whole model's init_weights() after parallelize_llama3_stage
// and to_empty of this rank's stages: the other stages' parameters are still on the meta
// device, where a random op consumes its draw and computes nothing (docs/random.md). Every
// op thus draws what it draws in the unsplit model, and each stage holds exactly the values
// of the unsplit model's init, on any layout (torchtitan initializes each stage on its own,
// so its pipelined model starts from other values than its unpipelined one).
inline void parallelize_llama3_stage(
    Llama3Stage& stage, const dtensor::DeviceMesh& mesh, bool loss_parallel,
    const dtensor::FullyShardOptions& fsdp = {}, const std::optional<Llama3Ac>& ac = std::nullopt,
    const std::optional<dtensor::ContextParallel>& cp = std::nullopt, const MoEParallel& ep = {}) {
  auto options = fsdp;
  if (!options.reshard_after_forward()) {
    options.reshard_after_forward(false);
  }
  auto held = [](const auto& m) -> std::shared_ptr<torch::nn::Module> {
    return m ? m.ptr() : nullptr;
  };
  parallelize_llama3_part({*stage, stage->blocks, stage->model_args, held(stage->tok_embeddings),
                           held(stage->norm), held(stage->output)},
                          mesh, llama3_stage_tp_plan(*stage, loss_parallel), options, ac, cp, ep);
}

} // namespace dtensor::models
