#pragma once

// torchtitan's models/llama3/infra/parallelize.py for the Llama-3 model: tensor parallelism
// (apply_tp), activation checkpointing (apply_ac) and fully_shard (apply_fsdp), applied from
// outside the model ([Note: models carry no parallelism] in models/llama3/model.h).
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <dtensor/activation_checkpoint.h>
#include <dtensor/context_parallel.h>
#include <dtensor/device_mesh.h>
#include <dtensor/fully_shard.h>
#include <dtensor/placement.h>
#include <dtensor/tensor_parallel.h>

#include <models/check.h>
#include <models/llama3/model.h>
#include <models/moe/parallelize.h>

namespace dtensor::models {

// torchtitan's apply_tp as one plan (no Float8; context parallelism is apply_cp below):
// tok_embeddings row-wise to Shard(1), so the residual stream is sequence-sharded between blocks;
// the norms SequenceParallel; attention / feed_forward gather their Shard(1) input once
// (PrepareModuleInput, whose hook runs when the block calls them; attention's second input, the
// rotary table, is taken as Replicate next to q / k sharded by heads); wq / wk / wv / w1 / w3
// column-wise; wo / w2 row-wise, reduce-scattered to Shard(1); output column-wise from Shard(1), to
// Shard(-1) DTensor logits with loss_parallel (for dtensor::LossParallel), else Replicate.
// Mixture-of-experts layers: each tp rank routes the tokens of its own sequence piece (the
// MoE's Shard(1) input taken as local rows, its output put back as Shard(1)), so no tp rank
// repeats another's all-to-alls (torchtitan#3167). Entries of modules the model lacks
// (feed_forward in an all-MoE model) are left out.
// The blocks of `model`, in order (what a model part's parallelization walks).
inline std::vector<Llama3BlockImpl*> llama3_blocks(Llama3& model) {
  std::vector<Llama3BlockImpl*> blocks;
  for (auto& layer : *model->layers) {
    blocks.push_back(layer->as<Llama3BlockImpl>());
  }
  return blocks;
}

// torchtitan's NoParallel: a module's parameters replicated over tp (Replicate DTensors),
// computing on Replicate DTensor inputs to Replicate DTensor outputs; the gradients its
// weights receive from sharded heads downstream come back summed over tp by the DTensors.
class ReplicateParallel : public dtensor::ParallelStyle {
 public:
  std::string name() const override { return "ReplicateParallel"; }
  void apply(torch::nn::Module& module, const dtensor::DeviceMesh& tp_mesh) const override {
    dtensor::distribute_module(module, tp_mesh);
  }
};

// [Note: latent attention under tensor parallelism] torchtitan's plan for MLA: the attention's
// input gathered to Replicate (as grouped-query attention's), the low-rank projections and
// their norms (wq_a, q_norm, wkv_a, kv_norm) replicated, the up-projections (wq or wq_b, wkv_b)
// column-wise with DTensor outputs, so that q / k / v are DTensors sharded by head and the
// rotary key, replicated, joins each rank's heads by the DTensors' own rules (its gradient
// summed over the heads of every rank); the kernel runs on each rank's heads, wo row-wise
// from them, reduce-scattered to Shard(1).
inline void add_mla_tp_plan(dtensor::ParallelizePlan& plan, const Llama3Args& args) {
  using dtensor::ColwiseParallel;
  const auto replicated = std::make_shared<ReplicateParallel>();
  const auto colwise = ColwiseParallel().use_local_output(false);
  if (args.mla()->q_lora_rank() == 0) {
    plan.insert(plan.end(), {{"layers.*.attention.wq", colwise}});
  } else {
    plan.push_back({"layers.*.attention.wq_a", replicated});
    plan.push_back({"layers.*.attention.q_norm", replicated});
    plan.insert(plan.end(), {{"layers.*.attention.wq_b", colwise}});
  }
  plan.push_back({"layers.*.attention.wkv_a", replicated});
  plan.push_back({"layers.*.attention.kv_norm", replicated});
  plan.insert(plan.end(), {{"layers.*.attention.wkv_b", colwise}});
}

inline dtensor::ParallelizePlan llama3_tp_plan(bool loss_parallel,
                                               const Llama3Args& args = Llama3Args()) {
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
  dtensor::ParallelizePlan plan = {
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
      {"layers.*.attention.wo", scattered},
      {"layers.*.ffn_norm", SequenceParallel()},
  };
  if (args.mla()) {
    add_mla_tp_plan(plan, args);
  } else {
    plan.insert(plan.end(), {{"layers.*.attention.w[qkv]", ColwiseParallel()}});
  }
  if (!args.moe() || args.n_dense_layers() > 0) {
    plan.insert(plan.end(), {{"layers.*.feed_forward", gathered},
                             {"layers.*.feed_forward.w[13]", ColwiseParallel()},
                             {"layers.*.feed_forward.w2", scattered}});
  }
  if (args.moe() && args.n_layers() > args.n_dense_layers()) {
    plan.insert(plan.end(), {{"layers.*.moe", dtensor::PrepareModuleInput()
                                                  .input_layouts(Shard(1))
                                                  .desired_input_layouts(Shard(1))
                                                  .use_local_output(true)},
                             {"layers.*.moe", dtensor::PrepareModuleOutput()
                                                  .output_layouts(Shard(1))
                                                  .desired_output_layouts(Shard(1))
                                                  .use_local_output(false)}});
  }
  return plan;
}

// [Note: the generator's plan] Generation runs a few tokens a row per forward: sequence
// parallelism (a residual stream sharded by position) has nothing to split there, so the
// generator's plan is Megatron's plain tensor parallelism: every rank holds the whole residual
// stream (plain tensors), tok_embeddings row-wise and wo / w2 row-wise all-reduced to Replicate,
// wq / wk / wv / w1 / w3 column-wise (each rank's heads: its KV cache holds only those), the
// norms plain and whole, output column-wise gathered to Replicate logits, so that every rank
// samples the same tokens. A forward costs one all-reduce for the embeddings, two a dense block,
// one all-gather for the logits. Mixture-of-experts layers: their experts sharded over the same
// ranks by expert parallelism (each rank routes the whole batch, so that every rank gets every
// token's output), the router and shared experts whole. Latent attention (DeepSeek-V3): its
// training plan's projections ([Note: latent attention under tensor parallelism]); it has no
// KV cache, so its generation recomputes.
inline dtensor::ParallelizePlan llama3_generator_plan(const Llama3Args& args) {
  using dtensor::ColwiseParallel;
  using dtensor::Replicate;
  using dtensor::RowwiseParallel;
  // The rotary table joins q / k (DTensors sharded by head) as Replicate, as in training.
  const auto attention_inputs =
      dtensor::PrepareModuleInput().more_input_layouts({Replicate()});
  dtensor::ParallelizePlan plan = {
      {"tok_embeddings", RowwiseParallel().input_layouts(Replicate())},
      {"output", ColwiseParallel().output_layouts(Replicate())},
      {"layers.*.attention", attention_inputs},
      {"layers.*.attention.wo", RowwiseParallel()},
  };
  if (args.mla()) { // ([Note: latent attention under tensor parallelism]; no KV cache)
    add_mla_tp_plan(plan, args);
  } else {
    plan.insert(plan.end(), {{"layers.*.attention.w[qkv]", ColwiseParallel()}});
  }
  if (args.qk_norm() && !args.mla()) { // per-head norms of q / k sharded by head: Replicate
    const auto replicated = std::make_shared<ReplicateParallel>();
    plan.push_back({"layers.*.attention.q_norm", replicated});
    plan.push_back({"layers.*.attention.k_norm", replicated});
  }
  if (!args.moe() || args.n_dense_layers() > 0) {
    plan.insert(plan.end(), {{"layers.*.feed_forward.w[13]", ColwiseParallel()},
                             {"layers.*.feed_forward.w2", RowwiseParallel()}});
  }
  return plan;
}

// A generator over the 1-D tp_mesh ([Note: the generator's plan]); the model's KV cache then
// holds each rank's heads only. Collective over tp_mesh.
inline void parallelize_llama3_generator(Llama3& model, const dtensor::DeviceMesh& tp_mesh) {
  const Llama3Args& a = model->model_args;
  DTENSOR_MODEL_CHECK(a.n_heads() % tp_mesh.size() == 0 && a.kv_heads() % tp_mesh.size() == 0,
                      "Llama3 generator: n_heads (", a.n_heads(), ") and n_kv_heads (",
                      a.kv_heads(), ") must be multiples of the tensor-parallel degree ",
                      tp_mesh.size());
  dtensor::parallelize_module(*model, tp_mesh, llama3_generator_plan(a));
  if (!a.moe() || tp_mesh.size() == 1) {
    return;
  }
  DTENSOR_MODEL_CHECK(a.moe()->num_experts() % tp_mesh.size() == 0, "Llama3 generator: ",
                      a.moe()->num_experts(), " experts do not divide over ", tp_mesh.size(),
                      " ranks");
  for (auto* block : llama3_blocks(model)) {
    if (block->moe) {
      dtensor::ExpertParallel().apply(*block->moe->experts, tp_mesh);
    }
  }
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
  dtensor::parallelize_module(*model, tp_mesh, llama3_tp_plan(loss_parallel, a));
}

// torchtitan's activation_checkpoint for the blocks: `options` (full, or per-op selective
// with a policy) on every `every`-th block, the blocks whose layer_id + 1 is a multiple of
// `every` (1: every block; torchtitan's selective_ac_option "2": layers 1, 3, 5, ...).
// [Note: layer-frequency checkpointing] torchtitan counts the blocks a rank wraps, so with
// pipeline stages its choice depends on the split; counting the model's layers checkpoints
// the same blocks on every layout.
struct Llama3Ac {
  // Implicit: options alone checkpoint every block.
  Llama3Ac(dtensor::ActivationCheckpointOptions o, int64_t n = 1)
      : options(std::move(o)), every(n) {}
  dtensor::ActivationCheckpointOptions options;
  int64_t every = 1;
};

// torchtitan's apply_ac (per-block): the blocks `ac` selects checkpointed with its options.
inline void apply_ac(const std::vector<Llama3BlockImpl*>& blocks, const Llama3Ac& ac) {
  DTENSOR_MODEL_CHECK(ac.every >= 1, "Llama3 apply_ac: every ", ac.every,
                      " (checkpoint every N-th block) must be at least 1");
  for (auto* block : blocks) {
    if ((block->layer_id + 1) % ac.every == 0) {
      dtensor::checkpoint_module(*block, ac.options);
    }
  }
}

inline void apply_ac(Llama3& model, const Llama3Ac& ac) {
  apply_ac(llama3_blocks(model), ac);
}

// torchtitan's context parallelism: every block's inner_attention computed by `style` over
// cp_mesh (context_parallel_attention on the layout the style was given for the step), and
// each attention's rotary table taken at this rank's sequence positions (torchtitan's sharded
// `positions`), so that the model itself is unchanged. The step's tokens and labels are sharded
// with dtensor::cp_shard on the same layout.
inline void apply_cp(const std::vector<Llama3BlockImpl*>& blocks,
                     const dtensor::DeviceMesh& cp_mesh, const dtensor::ContextParallel& style) {
  for (auto* block : blocks) {
    // (Latent attention's kernel is plain attention too: [Note: the kernel's form] in mla.h.)
    torch::nn::Module& attention =
        block->mla ? static_cast<torch::nn::Module&>(*block->mla) : *block->attention;
    style.apply(block->mla ? static_cast<torch::nn::Module&>(*block->mla->inner_attention)
                           : *block->attention->inner_attention,
                cp_mesh);
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

inline void apply_cp(Llama3& model, const dtensor::DeviceMesh& cp_mesh,
                     const dtensor::ContextParallel& style) {
  apply_cp(llama3_blocks(model), cp_mesh, style);
}

// [Note: token-parallel units under tensor parallelism] With tp > 1 the tp ranks of one data
// replica hold different tokens at a mixture-of-experts layer (each routes its own sequence
// piece, on plain local rows): for the router and the shared experts the tp ranks are data
// parallel, and their gradients must be summed over tp as well as over data parallelism. So
// they are a fully_shard unit of their own over (dp_replicate, dp_shard x tp flattened), the
// gradients divided by the data-parallel degree alone, as the experts' over (dp_replicate,
// efsdp) are. (The q / k norms need nothing of the kind: they see q / k as DTensors sharded
// by head, so their plain weights' gradients come back summed over tp.) With tp 1 they stay
// in their block's unit. With context parallelism the cp ranks hold yet other tokens: the unit
// spans dp_shard x cp x tp, and the data-parallel degree counts cp.

// Whether `mesh`'s root has a "cp" dimension (parallelize_llama3 with context parallelism).
inline bool has_cp_dim(const dtensor::DeviceMesh& mesh) {
  const dtensor::DeviceMesh root = mesh.root_mesh();
  const std::vector<std::string>& names = root.dim_names();
  return std::find(names.begin(), names.end(), "cp") != names.end();
}

// The token-parallel unit's mesh: (dp_replicate, dp_shard x tp), or (dp_replicate, dp_shard x
// cp x tp) with context parallelism.
inline dtensor::DeviceMesh token_parallel_mesh(const dtensor::DeviceMesh& mesh) {
  const dtensor::DeviceMesh root = mesh.root_mesh();
  const bool cp = has_cp_dim(root);
  const std::string name = cp ? "dp_shard_cp_tp" : "dp_shard_tp";
  const dtensor::DeviceMesh flat =
      cp ? root[{"dp_shard", "cp", "tp"}].flatten(name) : root[{"dp_shard", "tp"}].flatten(name);
  return root["dp_replicate"].size() > 1 ? root[{"dp_replicate", name}] : flat;
}

// torchtitan's MoE parallelism (apply_moe_ep_tp, and apply_fsdp's experts) for the model's
// mixture-of-experts layers: the experts of each over the sparse mesh (dp_replicate, efsdp,
// ep) on the dense ranks (moe_sparse_mesh: ep borrows tp's ranks first), sharded by expert
// over ep (ExpertParallel, the router's early exchange included) when ep > 1, and fully_shard
// as their own unit over (dp_replicate, efsdp), their gradients divided by the dense
// data-parallel degree as every other gradient. With tp > 1, the router and shared experts
// as their own unit ([Note: token-parallel units under tensor parallelism]). Call before the
// blocks' fully_shard. Collective.
inline void apply_moe(const std::vector<Llama3BlockImpl*>& blocks, const Llama3Args& a,
                      const dtensor::DeviceMesh& mesh, const MoEParallel& moe_parallel,
                      const dtensor::FullyShardOptions& fsdp) {
  const int64_t ep = moe_parallel.ep;
  DTENSOR_MODEL_CHECK(a.moe() || ep == 1, "Llama3 apply_moe: expert parallelism (ep ", ep,
                      ") on a model without mixture-of-experts layers");
  if (!a.moe()) {
    return;
  }
  DTENSOR_MODEL_CHECK(a.moe()->num_experts() % ep == 0,
                      "Llama3 apply_moe: ", a.moe()->num_experts(),
                      " experts do not divide over ep ", ep);
  // The ranks whose losses are averaged: data parallelism's, and context parallelism's (its
  // ranks hold other tokens of the same sequences); tp ranks share one loss.
  const int64_t dp_degree = mesh["dp_replicate"].size() * mesh["dp_shard"].size() *
                            (has_cp_dim(mesh) ? mesh["cp"].size() : 1);
  const dtensor::DeviceMesh sparse = moe_sparse_mesh(mesh, ep);
  std::optional<dtensor::DeviceMesh> token_mesh;
  if (mesh["tp"].size() > 1) {
    token_mesh = token_parallel_mesh(mesh);
  }
  for (auto* block : blocks) {
    MoE& moe = block->moe;
    if (!moe) {
      continue;
    }
    if (ep > 1) {
      apply_ep(moe, sparse, moe_parallel.options);
    }
    fully_shard_experts(moe, sparse, fsdp, dp_degree);
    if (token_mesh) {
      dtensor::FullyShardOptions options = fsdp;
      options.mesh(*token_mesh);
      dtensor::fully_shard(*moe, options)
          .set_gradient_divide_factor(static_cast<double>(dp_degree));
    }
  }
}

inline void apply_moe(Llama3& model, const dtensor::DeviceMesh& mesh, const MoEParallel& ep,
                      const dtensor::FullyShardOptions& fsdp) {
  apply_moe(llama3_blocks(model), model->model_args, mesh, ep, fsdp);
}

// One part of a Llama-3 model (the whole model, or a pipeline stage: models/llama3/pipeline.h):
// its root module, its blocks in order, the model's arguments, and the embeddings, final norm
// and output projection where the part holds them (null where not).
struct Llama3Part {
  torch::nn::Module& root;
  std::vector<Llama3BlockImpl*> blocks;
  const Llama3Args& args;
  std::shared_ptr<torch::nn::Module> tok_embeddings = nullptr;
  std::shared_ptr<torch::nn::Module> norm = nullptr;
  std::shared_ptr<torch::nn::Module> output = nullptr;
};

// torchtitan's apply_fsdp units of a part, bottom-up: tok_embeddings, each block, [norm,
// output] as one unit, then the part's root (which then holds no parameter of its own: it
// starts and ends each forward and backward). `options`: the blocks' (and the root's) options.
inline void fully_shard_part(const Llama3Part& part, const dtensor::FullyShardOptions& options) {
  if (part.tok_embeddings) {
    dtensor::fully_shard(*part.tok_embeddings, options);
  }
  for (auto* block : part.blocks) {
    dtensor::fully_shard(*block, options);
  }
  if (part.norm && part.output) {
    dtensor::fully_shard({part.norm, part.output}, options);
  }
  dtensor::fully_shard(part.root, options);
}

// torchtitan's parallelize_llama applied to one model part, given its tensor-parallel `plan`
// (every part the same steps, as torchtitan's parallelize_fn on each of its model_parts): the
// plan over mesh["tp"], apply_cp over mesh["cp"] with `cp`, apply_ac when `ac` is set, apply_moe,
// then fully_shard_part's units over (dp_replicate, dp_shard), or with
// cp over (dp_replicate, dp_shard x cp) flattened (torchtitan's fsdp = dp_shard x cp: the cp
// ranks hold different tokens of the same sequences, so their gradients are reduced like data
// parallelism's). `mesh` is any mesh with those names (a "pp" dimension of its root is left
// alone). Collective over the part's ranks.
inline void parallelize_llama3_part(const Llama3Part& part, const dtensor::DeviceMesh& mesh,
                                    const dtensor::ParallelizePlan& plan,
                                    const dtensor::FullyShardOptions& fsdp,
                                    const std::optional<Llama3Ac>& ac,
                                    const std::optional<dtensor::ContextParallel>& cp,
                                    const MoEParallel& ep) {
  const Llama3Args& a = part.args;
  const int64_t tp = mesh["tp"].size();
  DTENSOR_MODEL_CHECK(a.n_heads() % tp == 0 && a.kv_heads() % tp == 0, "Llama3: n_heads (",
                      a.n_heads(), ") and n_kv_heads (", a.kv_heads(),
                      ") must be multiples of the tensor-parallel degree ", tp);
  dtensor::parallelize_module(part.root, mesh["tp"], plan);
  if (cp) {
    apply_cp(part.blocks, mesh["cp"], *cp);
  }
  if (ac) {
    apply_ac(part.blocks, *ac);
  }
  auto options = fsdp;
  if (cp) {
    mesh[{"dp_shard", "cp"}].flatten("dp_shard_cp");
    options.mesh(mesh.root_mesh()[{"dp_replicate", "dp_shard_cp"}]);
  } else {
    options.mesh(mesh[{"dp_replicate", "dp_shard"}]);
  }
  apply_moe(part.blocks, a, mesh, ep, fsdp);
  fully_shard_part(part, options);
}

// torchtitan's parallelize_llama on a mesh named (dp_replicate, dp_shard, tp), or (dp_replicate,
// dp_shard, cp, tp) with `cp`: parallelize_llama3_part on the whole model with llama3_tp_plan.
// HSDP when dp_replicate > 1; mixed precision from `fsdp`. Mixture-of-experts layers:
// apply_moe, with `ep` (which borrows ranks from cp as from dp_shard and tp: MoE layers are
// token-wise, so the cp ranks' sequence pieces route like any other tokens). Collective.
inline void parallelize_llama3(Llama3& model, const dtensor::DeviceMesh& mesh, bool loss_parallel,
                               const dtensor::FullyShardOptions& fsdp = {},
                               const std::optional<Llama3Ac>& ac = std::nullopt,
                               const std::optional<dtensor::ContextParallel>& cp = std::nullopt,
                               const MoEParallel& ep = {}) {
  const Llama3Args& a = model->model_args;
  parallelize_llama3_part({*model, llama3_blocks(model), a, model->tok_embeddings.ptr(),
                           model->norm.ptr(), model->output.ptr()},
                          mesh, llama3_tp_plan(loss_parallel, a), fsdp, ac, cp, ep);
}

} // namespace dtensor::models
