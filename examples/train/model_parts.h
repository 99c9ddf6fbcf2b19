#pragma once

// The recipe's model_parts (torchtitan's): the model built on the meta device, as the parts
// this rank runs: the whole model without --pp, or, with it, this rank's pipeline stages (cut
// by layer, models/llama3/pipeline.h) driven by a PyTorch schedule over pp. Each part is
// parallelized the same way (parallelize_llama3_part: tensor, context and expert parallelism,
// activation checkpointing, fully_shard), materialized and initialized to the unsplit model's
// values (or read from a Hugging Face folder). Everything the Trainer does with the model goes
// through here, on every layout: the step's forwards and backwards, a forward-only pass of the
// whole model (validation, sampling), clipping, the model's state for checkpoints and
// Hugging Face folders. docs/recipe.md, "The Trainer".
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/context_parallel.h>
#include <dtensor/device_mesh.h>
#include <dtensor/pipelining.h>
#include <dtensor/state_dict.h>

#include <models/llama3.h>

#include "llama_flags.h"
#include "parallel_dims.h"
#include "recipe_data.h"

namespace dtensor::train {

// One part: its index among the model's stages (0 of 1 without --pp), its module (the
// whole Llama3, or a Llama3Stage holding the whole model's modules under their names) and
// its forward, through the module seam (dtensor::call).
struct ModelPart {
  int stage = 0;
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
};

class ModelParts {
 public:
  // `model` built on the meta device (float8 already converted); `mesh` the world mesh of
  // `dims`; with cp the ContextParallel style of --cp-method. Collective.
  ModelParts(const Flags& f, const ParallelDims& dims, const DeviceMesh& mesh,
             models::Llama3& model, const at::Device& device);
  ~ModelParts();
  ModelParts(const ModelParts&) = delete;
  ModelParts& operator=(const ModelParts&) = delete;

  const std::vector<ModelPart>& parts() const { return parts_; }
  // A step's inputs and targets from this rank's rows of tokens (seq + 1 each): under --cp
  // its positions of them (--cp-balance; every rank of a cp group loads the same rows).
  // With split_documents, the rows' documents too, for the forwards that follow.
  // `whole`: every row under one layout (a forward of them all at once, evaluate's);
  // otherwise each forward's rows under their own ([Note: a layout per microbatch]).
  std::pair<at::Tensor, at::Tensor> inputs(const at::Tensor& rows, bool whole = false);
  // Under --cp, the last inputs' attention work on the busiest cp rank of each forward, summed,
  // over the mean rank's (1: balanced; CpLayout::work).
  double cp_imbalance() const { return imbalance_; }
  // --attn-mask documents on packed data: a document ends after each `eos` of a row's inputs
  // (torchtitan's block_causal mask), and attention stays inside documents in every layout
  // ([Note: document masks] in models/llama3/documents.h; with cp, the layout's documents).
  void split_documents(int64_t eos) { eos_ = eos; }
  // This rank's positions of a sequence (--seq, or its cp piece).
  int64_t local_len() const;
  // The layout, as the job's first line says it: "pp=2 (1F1B, ...), dp_replicate=1, ...".
  std::string layout() const;
  std::vector<at::Tensor> parameters() const;
  const models::Llama3Args& args() const { return args_; }

  // One step's forwards and backwards over this rank's rows `x` / `targets` (its cp piece
  // under --cp), in f.accumulation microbatches, gradients as the global batch's mean loss
  // (docs/recipe.md, "Gradient accumulation"). Returns this rank's loss of the step,
  // detached (zero on ranks without the last stage). `phase` names the phases (--report).
  at::Tensor forward_backward(const at::Tensor& x, const at::Tensor& targets,
                              const std::function<void(const char*)>& phase);
  // The whole model's forward of `x` without gradients, stage after stage (each stage's
  // output handed to the next stage's ranks over pp), `head` applied to the logits on the
  // last stage's ranks; its result, a 1-D double tensor of `n` values, on every rank.
  at::Tensor evaluate(const at::Tensor& x, int64_t n,
                      const std::function<at::Tensor(const at::Tensor&)>& head);
  // The step's loss as forward_backward returned it on this rank, averaged over the
  // data-parallel (and cp) ranks: under --pp only the last stage's ranks hold one (zero
  // elsewhere), theirs scaled by pp and averaged over the world. Collective.
  double mean_loss(const at::Tensor& loss) const;
  // The tensor-parallel degree (the closing sample's generator has it too).
  int64_t tp() const { return dims_.tp; }
  // clip_grad_norm_ over every part's gradients (the dense and expert meshes and pp).
  at::Tensor clip_grad_norm(double max_norm);
  // After the optimizer step: the next step's float8 scales (--float8-all-gather).
  void after_optimizer_step();
  // The model's state of this rank's parts under the whole model's names, and its inverse.
  StateDict model_state();
  void load_model_state(const StateDict& state);
  // Hugging Face folders (collective): written from every part's state, read into it.
  void export_hf(const std::string& dir, const models::HfExportOptions& options);
  void load_hf(const std::string& dir);
  // This rank's parts as one module (MoE layers: the load-balancing bias), and the group of
  // the ranks holding the same parts (the world without pp). Collective on first use.
  torch::nn::Module& module() { return *holder_; }
  Group part_group() const;
  std::string describe() const { return describe_; }

 private:
  at::Tensor microbatch(const at::Tensor& x, const at::Tensor& y,
                        const std::function<void(const char*)>& phase);
  at::Tensor hand_over(const at::Tensor& out, int owner);
  void build_pipeline(const FullyShardOptions& fsdp,
                      const std::optional<models::Llama3Ac>& ac);
  void init_values();

  CpLayout cp_layout() const;
  // The layout of the step's rows [first, first + count), from their documents.
  CpLayout layout_of(int64_t first, int64_t count) const;
  // The documents of the step's rows [first, first + count) (none without split_documents).
  std::vector<std::vector<int64_t>> documents(int64_t first, int64_t count) const;
  // The documents of this rank's rows [first, first + count) of the step, on the model and
  // the cp layout, for the forwards that follow.
  void use_documents(int64_t first, int64_t count);

  const Flags& f_;
  ParallelDims dims_;
  std::optional<ContextParallel> cp_;
  DeviceMesh mesh_;
  models::Llama3 model_;
  models::Llama3Args args_;
  at::Device device_;
  std::vector<ModelPart> parts_;
  std::vector<int> placement_; // each stage's pipeline rank ({0} without --pp)
  std::shared_ptr<torch::nn::Module> holder_;
  std::unique_ptr<PipelineSchedule> schedule_; // --pp
  std::string describe_;
  int64_t eos_ = -1;                        // split_documents
  std::vector<std::vector<int64_t>> docs_;  // this rank's rows' documents, this step
  int64_t docs_first_ = 0, pp_rows_ = 0;    // the accumulation microbatch's rows; pp's
  CpBalance balance_ = CpBalance::HeadTail; // --cp-balance
  double imbalance_ = 1.0;                  // cp_imbalance
};

// Greedy continuation of `prompt` by `n` tokens on a tensor-parallel generator filled from the
// trained parts ([Note: the recipe samples with the generator] in model_parts.cpp). Collective
// over the world; the prompt and its continuation must fit the model's max_seq_len.
std::string sample(ModelParts& parts, const RecipeData& vocab, const std::string& prompt,
                   int64_t n, const at::Device& device);

} // namespace dtensor::train
