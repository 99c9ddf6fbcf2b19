#pragma once

// torchtitan's models/llama3/infra/parallelize.py for the Llama-3 model: tensor parallelism
// (apply_tp), activation checkpointing (apply_ac) and fully_shard (apply_fsdp), applied from
// outside the model ([Note: models carry no parallelism] in models/llama3/model.h).
#include <memory>
#include <optional>

#include <dtensor/activation_checkpoint.h>
#include <dtensor/context_parallel.h>
#include <dtensor/device_mesh.h>
#include <dtensor/fully_shard.h>
#include <dtensor/placement.h>
#include <dtensor/tensor_parallel.h>

#include <models/check.h>
#include <models/llama3/model.h>

namespace dtensor::models {

// torchtitan's apply_tp as one plan (no Float8; context parallelism is apply_cp below):
// tok_embeddings row-wise to Shard(1), so the residual stream is sequence-sharded between blocks;
// the norms SequenceParallel; attention / feed_forward gather their Shard(1) input once
// (PrepareModuleInput, whose hook runs when the block calls them; attention's second input, the
// rotary table, is taken as Replicate next to q / k sharded by heads); wq / wk / wv / w1 / w3
// column-wise; wo / w2 row-wise, reduce-scattered to Shard(1); output column-wise from Shard(1), to
// Shard(-1) DTensor logits with loss_parallel (for dtensor::LossParallel), else Replicate.
inline dtensor::ParallelizePlan llama3_tp_plan(bool loss_parallel) {
  using dtensor::ColwiseParallel;
  using dtensor::Replicate;
  using dtensor::RowwiseParallel;
  using dtensor::SequenceParallel;
  using dtensor::Shard;
  const auto gathered =
      dtensor::PrepareModuleInput().input_layouts(Shard(1)).desired_input_layouts(Replicate());
  const auto attention_inputs =
      dtensor::PrepareModuleInput(gathered).more_input_layouts({Replicate()});
  const auto scattered = RowwiseParallel().output_layouts(Shard(1));
  return {
      {"tok_embeddings", RowwiseParallel().input_layouts(Replicate()).output_layouts(Shard(1))},
      {"norm", SequenceParallel()},
      // Replicate logits (loss_parallel off) are gathered as they leave `output`
      // (test_llama3 checks them against the plain model's).
      {"output", ColwiseParallel()
                     .input_layouts(Shard(1))
                     .output_layouts(loss_parallel ? Shard(-1) : Replicate())
                     .use_local_output(!loss_parallel)},
      {"layers.*.attention_norm", SequenceParallel()},
      {"layers.*.attention", attention_inputs},
      {"layers.*.attention.w[qkv]", ColwiseParallel()},
      {"layers.*.attention.wo", scattered},
      {"layers.*.ffn_norm", SequenceParallel()},
      {"layers.*.feed_forward", gathered},
      {"layers.*.feed_forward.w[13]", ColwiseParallel()},
      {"layers.*.feed_forward.w2", scattered},
  };
}

// Parallelizes `model` over the 1-D tp_mesh (collective: every rank of tp_mesh calls it).
// Heads are sharded: n_heads and n_kv_heads must be multiples of the mesh size, so that
// inner_attention's local kv heads are those of the local q heads. freqs_cis stays a plain buffer,
// taken as Replicate where attention is called.
inline void apply_tp(Llama3& model, const dtensor::DeviceMesh& tp_mesh, bool loss_parallel) {
  const Llama3Args& a = model->model_args;
  DTENSOR_MODEL_CHECK(a.n_heads() % tp_mesh.size() == 0 && a.kv_heads() % tp_mesh.size() == 0,
                      "Llama3 apply_tp: n_heads (", a.n_heads(), ") and n_kv_heads (", a.kv_heads(),
                      ") must be multiples of the tensor-parallel degree ", tp_mesh.size());
  dtensor::parallelize_module(*model, tp_mesh, llama3_tp_plan(loss_parallel));
}

// torchtitan's apply_ac (per-block): every block's forward checkpointed with `options`.
inline void apply_ac(Llama3& model, const dtensor::ActivationCheckpointOptions& options) {
  for (auto& layer : *model->layers) {
    dtensor::checkpoint_module(*layer, options);
  }
}

// torchtitan's context parallelism: every block's inner_attention computed by `style` over
// cp_mesh (context_parallel_attention on the layout the style was given for the step), and
// each attention's rotary table taken at this rank's sequence positions (torchtitan's sharded
// `positions`), so that the model itself is unchanged. The step's tokens and labels are sharded
// with dtensor::cp_shard on the same layout.
inline void apply_cp(Llama3& model, const dtensor::DeviceMesh& cp_mesh,
                     const dtensor::ContextParallel& style) {
  for (auto& layer : *model->layers) {
    auto& attention = *layer->as<Llama3BlockImpl>()->attention;
    style.apply(*attention.inner_attention, cp_mesh);
    dtensor::register_module_hooks(
        attention, dtensor::ModuleHooks()
                       .name("ContextParallel positions")
                       .order(dtensor::hook_order::kContextParallel)
                       .pre_forward([style, cp_mesh](torch::nn::Module&, dtensor::TensorList& in) {
                         if (!style.enabled()) {
                           return;
                         }
                         const dtensor::CpLayout layout = style.layout();
                         in[1] = dtensor::cp_shard(in[1].narrow(0, 0, layout.seq_len()), 0, layout,
                                                   cp_mesh);
                       }));
  }
}

// torchtitan's parallelize_llama on a mesh named (dp_replicate, dp_shard, tp), or (dp_replicate,
// dp_shard, cp, tp) with `cp`: apply_tp over tp, apply_cp over cp, apply_ac when `ac` is set,
// then fully_shard on each block and on the root over (dp_replicate, dp_shard), or with cp over
// (dp_replicate, dp_shard x cp) flattened (torchtitan's fsdp = dp_shard x cp: the cp ranks
// hold different tokens of the same sequences, so their gradients are reduced like data
// parallelism's). HSDP when dp_replicate > 1; mixed precision from `fsdp`. Collective.
inline void
parallelize_llama3(Llama3& model, const dtensor::DeviceMesh& mesh, bool loss_parallel,
                   const dtensor::FullyShardOptions& fsdp = {},
                   const std::optional<dtensor::ActivationCheckpointOptions>& ac = std::nullopt,
                   const std::optional<dtensor::ContextParallel>& cp = std::nullopt) {
  apply_tp(model, mesh["tp"], loss_parallel);
  if (cp) {
    apply_cp(model, mesh["cp"], *cp);
  }
  if (ac) {
    apply_ac(model, *ac);
  }
  auto options = fsdp;
  if (cp) {
    mesh[{"dp_shard", "cp"}].flatten("dp_shard_cp");
    options.mesh(mesh.root_mesh()[{"dp_replicate", "dp_shard_cp"}]);
  } else {
    options.mesh(mesh[{"dp_replicate", "dp_shard"}]);
  }
  for (auto& layer : *model->layers) {
    dtensor::fully_shard(*layer, options);
  }
  dtensor::fully_shard(*model, options);
}

} // namespace dtensor::models
