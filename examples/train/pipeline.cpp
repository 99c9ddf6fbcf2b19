// The Llama 3 recipe's pipeline part (examples/train/pipeline.h).
#include "pipeline.h"

#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include <dtensor/dtensor.h>
#include <dtensor/float8.h>
#include <dtensor/materialize.h>
#include <dtensor/pipeline_schedule.h>
#include <dtensor/random.h>
#include <dtensor/tensor_parallel.h>

#include <models/check.h>

namespace dtensor::train {

std::string pipeline_flag_error(const Flags& f, int64_t world) {
  if (f.pp < 1 || world % f.pp != 0) {
    return "--pp " + std::to_string(f.pp) + " does not divide the " + std::to_string(world) +
           " ranks";
  }
  if (f.microbatches < 0) {
    return "--microbatches must be positive";
  }
  if (f.pp == 1) {
    return f.microbatches > 0 ? "--microbatches needs --pp" : "";
  }
  if (f.cp > 1) {
    return "--pp with --cp is not supported yet (context parallelism inside pipeline stages)";
  }
  for (const auto& [flag, set] : {std::pair{"--export-hf", !f.export_hf.empty()},
                                  {"--init-from-hf", !f.init_from_hf.empty()}}) {
    if (set) {
      return std::string("--pp with ") + flag +
             " is not supported yet (no rank holds the whole model: save a checkpoint with "
             "--pp, then resume it without)";
    }
  }
  return "";
}

int64_t pipeline_microbatches(const Flags& f) {
  if (f.pp == 1) {
    return 1; // no pipeline: the rank's rows in one piece
  }
  return f.microbatches > 0 ? f.microbatches : 2 * f.pp;
}

namespace {

// A microbatch's loss: the cross-entropy sum over its tokens divided by `tokens`, this rank's
// token count of the step (vocab-sharded logits under LossParallel, as the unpipelined
// recipe's).
PipelineLoss token_sum_loss(double tokens) {
  return [tokens](const at::Tensor& logits, const at::Tensor& targets) {
    namespace F = torch::nn::functional;
    return F::cross_entropy(logits.to(at::kFloat).flatten(0, 1), targets.flatten(),
                            F::CrossEntropyFuncOptions().reduction(torch::kSum)) /
           tokens;
  };
}

} // namespace

PipelineRecipe::PipelineRecipe(const Flags& f, const DeviceMesh& mesh, models::Llama3& model,
                               const FullyShardOptions& fsdp,
                               const std::optional<ActivationCheckpointOptions>& ac,
                               const at::Device& device) {
  const ScheduleKind kind = schedule_kind(f.pp_schedule);
  const int pp = static_cast<int>(f.pp);
  const int per_rank = is_single_stage(kind) ? 1 : 2;
  const int num_stages = pp * per_rank;
  const int micro = static_cast<int>(pipeline_microbatches(f));
  const PipelineOrder order = generate_schedule(kind, pp, micro, per_rank);
  const std::vector<int> placement = validate_schedule(order, num_stages, micro);
  const Group group = mesh.get_group("pp");
  const DeviceMesh inner = mesh[{"dp_replicate", "dp_shard", "tp"}];
  inner_ = inner;
  holder_ = std::make_shared<torch::nn::Module>("Stages");
  std::vector<PipelineStage> stages;
  for (int s = 0; s < num_stages; ++s) {
    if (placement[static_cast<size_t>(s)] != group.rank()) {
      continue;
    }
    models::Llama3Stage stage(model, s, num_stages);
    models::parallelize_llama3_stage(stage, inner, /*loss_parallel=*/true, fsdp, ac);
    to_empty(*stage, device);
    last_ = last_ || s == num_stages - 1;
    stages_.push_back(stage);
    holder_->register_module("stage" + std::to_string(s), stage.ptr());
    // Sequence-parallel hidden states travel as their local tensors and are rebuilt over tp.
    stages.emplace_back(
        s, stage.ptr(), [stage](const at::Tensor& x) mutable { return stage->forward(x); },
        mesh["tp"]);
    describe_ += (describe_.empty() ? "" : ", ") + std::to_string(s);
  }
  // [Note: initializing stages built on meta] (models/llama3/pipeline.h).
  set_rng_state({true, static_cast<uint64_t>(f.seed), 0}); // the same values on every layout (docs/random.md)
  model->init_weights();
  const DeviceMesh dp = mesh[{"dp_replicate", "dp_shard"}];
  const double tokens = static_cast<double>(f.batch / dp.size() * f.seq);
  // The loss is a sum over the rank's tokens: no division by the microbatches afterwards
  // (torchtitan's scale_grads=False).
  schedule_ = std::make_unique<PipelineSchedule>(std::move(stages), group, order, micro,
                                                 token_sum_loss(tokens),
                                                 PipelineOptions().scale_grads(false));
  describe_ = std::string(schedule_name(kind)) + ", " + std::to_string(micro) +
              " microbatches, stages " + describe_ + " of " + std::to_string(num_stages) + " here";
}

PipelineRecipe::~PipelineRecipe() = default;

std::vector<at::Tensor> PipelineRecipe::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& stage : stages_) {
    for (const auto& p : stage->parameters()) {
      out.push_back(p);
    }
  }
  return out;
}

void PipelineRecipe::precompute_float8_scales() {
  for (auto& stage : stages_) {
    precompute_float8_dynamic_scale_for_fsdp(*stage);
  }
}

StateDict PipelineRecipe::model_state() {
  StateDict out;
  for (auto& stage : stages_) {
    for (const auto& item : get_model_state_dict(*stage)) {
      if (!out.contains(item.key())) { // freqs_cis: every stage's, the same tensor
        out.insert(item.key(), item.value());
      }
    }
  }
  return out;
}

void PipelineRecipe::load_model_state(const StateDict& state) {
  for (auto& stage : stages_) {
    StateDict mine;
    for (const auto& item : get_model_state_dict(*stage)) {
      const at::Tensor* value = state.find(item.key());
      DTENSOR_MODEL_CHECK(value != nullptr, "train --pp: the state has no '", item.key(),
                          "' for stage ", stage->stage);
      mine.insert(item.key(), *value);
    }
    set_model_state_dict(*stage, mine);
  }
}

at::Tensor PipelineRecipe::step(const at::Tensor& tokens, const at::Tensor& targets) {
  LossParallel vocab_parallel; // the last stage's logits stay vocab-sharded
  const std::vector<at::Tensor> losses = schedule_->step(tokens, targets);
  at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(tokens.device()));
  for (const auto& l : losses) {
    total += (is_dtensor(l) ? DTensor(l).to_local() : l).detach().to(at::kFloat);
  }
  return total;
}

} // namespace dtensor::train
