#pragma once

// The Llama 3 recipe under --pp (docs/pipeline.md "The recipe"): the model built on the meta
// device is cut into stages by layer (models/llama3/pipeline.h), this rank's stages are
// parallelized over the 4-D mesh's (dp_replicate, dp_shard, tp), materialized and
// initialized to the unsplit model's values, and a PyTorch schedule drives them over pp.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/activation_checkpoint.h>
#include <dtensor/device_mesh.h>
#include <dtensor/fully_shard.h>
#include <dtensor/pipelining.h>
#include <dtensor/state_dict.h>

#include <models/llama3/pipeline.h>

#include "llama_flags.h"

namespace dtensor::train {

// What is wrong with --pp and the flags beside it for `world` ranks ("" when nothing): the
// same text on every rank, before any group is made.
std::string pipeline_flag_error(const Flags& f, int64_t world);

// The schedule's microbatches per step (--microbatches, or 2 x pp; 1 without --pp).
int64_t pipeline_microbatches(const Flags& f);

class PipelineRecipe {
 public:
  // `model` built on the meta device; `mesh` (pp, dp_replicate, dp_shard, tp).
  PipelineRecipe(const Flags& f, const DeviceMesh& mesh, models::Llama3& model,
                 const FullyShardOptions& fsdp,
                 const std::optional<ActivationCheckpointOptions>& ac, const at::Device& device);
  ~PipelineRecipe();
  PipelineRecipe(const PipelineRecipe&) = delete;
  PipelineRecipe& operator=(const PipelineRecipe&) = delete;

  // This rank's parameters (its stages').
  std::vector<at::Tensor> parameters() const;
  // One step's forwards and backwards of every microbatch of this data-parallel rank's
  // `tokens` / `targets`: the sum of the microbatches' losses on the ranks of the last stage,
  // each a cross-entropy sum over its tokens divided by this rank's token count (the loss
  // contract: gradients as the unpipelined recipe's mean loss); zero elsewhere.
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& targets);
  bool holds_last_stage() const { return last_; }
  // --float8-all-gather: the next step's float8 scales of this rank's stages.
  void precompute_float8_scales();
  // This rank's stages' model state (get_model_state_dict of each, under the whole model's
  // names), and its inverse (the names of this rank's stages taken from `state`).
  StateDict model_state();
  void load_model_state(const StateDict& state);
  const std::string& describe() const { return describe_; }
  // This rank's stages as one module (their MoE layers: the load-balancing bias), and the
  // group of the ranks holding the same stages (dp_replicate x dp_shard x tp, flattened).
  torch::nn::Module& stage_module() { return *holder_; }
  // Collective on first use (a new group).
  Group stage_group() const { return inner_.flatten("pp_stage_ranks").get_group(); }

 private:
  std::vector<models::Llama3Stage> stages_;
  std::shared_ptr<torch::nn::Module> holder_;
  DeviceMesh inner_;
  std::unique_ptr<PipelineSchedule> schedule_;
  bool last_ = false;
  std::string describe_;
};

} // namespace dtensor::train
