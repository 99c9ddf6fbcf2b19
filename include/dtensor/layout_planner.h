#pragma once
// Choosing the layout: a decoder transformer's step costed in closed form for any layout
// (dp_replicate x dp_shard x tp x pp x cp x ep, the pipeline schedule and its virtual stages,
// the context-parallel method, activation checkpointing, the microbatch), its memory and time
// broken down by term, and a search over every layout of a world ranked by planned tokens/s
// (docs/simulation.md, "Choosing the layout"). A chosen layout's plan is then checked by
// `train --simulate`, which runs the real program on sampled ranks.
#include <cstdint>
#include <string>
#include <vector>

#include <torch/arg.h>

#include <dtensor/collective_cost.h>

namespace dtensor {

// A decoder transformer's shape: Llama 3 (dense), Qwen3 / GPT-OSS (MoE), DeepSeek-V3 (MoE and
// latent attention). Every block is an attention and a SwiGLU feed-forward.
struct TransformerShape {
  TORCH_ARG(std::string, name) = "custom";
  TORCH_ARG(int64_t, dim) = 4096;
  TORCH_ARG(int64_t, layers) = 32;
  TORCH_ARG(int64_t, heads) = 32;
  TORCH_ARG(int64_t, kv_heads) = 8;
  TORCH_ARG(int64_t, head_dim) = 128;     // q / k / v per head (latent attention: q / k's nope)
  TORCH_ARG(int64_t, ffn_hidden) = 14336; // a dense block's feed-forward width
  TORCH_ARG(int64_t, vocab) = 128256;
  // Mixture of experts (experts 0: dense). The first dense_layers blocks stay dense.
  TORCH_ARG(int64_t, experts) = 0;
  TORCH_ARG(int64_t, experts_per_token) = 0;
  TORCH_ARG(int64_t, expert_hidden) = 0;
  TORCH_ARG(int64_t, shared_experts) = 0;
  TORCH_ARG(int64_t, dense_layers) = 0;
  // Latent attention (kv_lora_rank > 0): DeepSeek-V3's shapes.
  TORCH_ARG(int64_t, q_lora_rank) = 0;
  TORCH_ARG(int64_t, kv_lora_rank) = 0;
  TORCH_ARG(int64_t, qk_rope_head_dim) = 0;
  TORCH_ARG(int64_t, v_head_dim) = 0;
  // Every other block attends to this many previous tokens only (GPT-OSS); 0: none.
  TORCH_ARG(int64_t, sliding_window) = 0;
};

// Shapes by name (Hugging Face's config.json of each): llama3-8b, llama3-70b, llama3-405b,
// qwen3-30b-a3b, qwen3-235b-a22b, gpt-oss-120b, deepseek-v3-16b, deepseek-v3 (671B). Throws
// for other names, listing these.
TransformerShape transformer_shape(const std::string& name);
std::vector<std::string> transformer_shape_names();

// Parameters of one block (`moe`: an MoE block), and of the whole model.
int64_t block_parameters(const TransformerShape& m, bool moe);
int64_t model_parameters(const TransformerShape& m);

enum class CheckpointMode { None, Selective, Full };
std::string to_string(CheckpointMode policy);

// One layout of a world of dp_replicate x dp_shard x cp x tp x pp ranks. fully_shard shards
// over dp_shard x cp (torchtitan's dp_shard_cp); ep borrows its ranks from dp_shard x cp, or,
// a multiple of tp, from dp_shard x cp x tp (the experts then whole on a rank).
struct Layout {
  TORCH_ARG(int64_t, dp_replicate) = 1;
  TORCH_ARG(int64_t, dp_shard) = 1;
  TORCH_ARG(int64_t, tp) = 1;
  TORCH_ARG(int64_t, pp) = 1;
  TORCH_ARG(std::string, schedule) = "1F1B"; // PyTorch's names; pp 1: none
  TORCH_ARG(int64_t, virtual_stages) = 1;    // stages per pipeline rank
  TORCH_ARG(int64_t, cp) = 1;
  TORCH_ARG(std::string, cp_method) = "allgather"; // allgather | ring | ulysses
  TORCH_ARG(int64_t, ep) = 1;
  TORCH_ARG(CheckpointMode, checkpoint) = CheckpointMode::Full;
  TORCH_ARG(int64_t, microbatch) = 1; // sequences per microbatch

 public:
  int64_t world() const { return dp_replicate_ * dp_shard_ * tp_ * pp_ * cp_; }
};
// "dp_rep 1 x dp_shard 8 x tp 8 x pp 8 (Interleaved1F1B x2) x cp 1, ep 1, full AC, mb 1"
std::string to_string(const Layout& layout);

struct JobShape {
  TORCH_ARG(int64_t, seq) = 8192;
  TORCH_ARG(int64_t, global_batch) = 256; // sequences per step
  // The block's products in float8 (attention, the output and the loss in bf16).
  TORCH_ARG(bool, float8) = false;
};

// The `train --simulate` flags that run this layout's plan on sampled ranks (the recipe runs
// two stages per pipeline rank for a multi-stage schedule, whatever virtual_stages says).
std::string simulate_flags(const Layout& layout, const JobShape& job);

struct PlannerOptions {
  TORCH_ARG(ClusterSpec, cluster) = ClusterSpec();
  // The fraction of the cluster's dense peak the kernels achieve (400 of the H100's 989
  // TFLOP/s: the time model's default); float8 products run at twice the peak, same fraction.
  TORCH_ARG(double, efficiency) = 400.0 / 989.0;
  // Attention kernels' own fraction of the peak (0: `efficiency`): FlashAttention runs below
  // the products; 0.2, fitted to torchtitan's 8B row at 32k tokens (docs/simulation.md,
  // "Choosing the layout"), predicts its 64k-256k rows.
  TORCH_ARG(double, attention_efficiency) = 0.2;
  // Tensor parallelism's collectives overlapped with the block's products (asynchronous TP,
  // Megatron's TP communication overlap), and the experts' all-to-alls with the block's compute
  // (Megatron's EP overlap); off, as dtensor issues both: blocking.
  TORCH_ARG(bool, tp_overlap) = false;
  TORCH_ARG(bool, ep_overlap) = false;
  // Device memory a layout may use (0: the cluster's memory_gib), and the caching allocator's
  // reserve over what is alive (fragmentation), a stated factor.
  TORCH_ARG(double, memory_gib) = 0;
  TORCH_ARG(double, fragmentation) = 1.1;
};

// Bytes per rank at the step's peak, by term (the busiest pipeline stage).
struct MemoryTerms {
  double parameters = 0;  // fp32 shards
  double gradients = 0;   // fp32 shards
  double optimizer = 0;   // AdamW's two fp32 states
  double unsharded = 0;   // bf16 parameters gathered (and fp32 gradients accumulated, pp)
  double activations = 0; // saved for backward, every microbatch in flight
  double logits = 0;      // the output's logits and the loss's fp32 copies
  double buffers = 0;     // communication buffers (tp, cp, ep exchanges)
  double total = 0;       // the sum x fragmentation
};

// Seconds per step, by term.
struct TimeTerms {
  double compute = 0; // the rank's kernels, recomputation included
  double tp = 0;      // exposed (tensor parallelism's collectives block compute)
  double cp = 0;      // exposed part of the K/V exchanges
  double ep = 0;      // the token exchanges (blocking)
  double dp = 0;      // fully_shard / replicate traffic not hidden under compute
  double pp = 0;      // the bubble and the stage-boundary sends
  double step = 0;
  double tokens_per_second_per_gpu = 0;
  double mfu = 0; // 6 x active parameters (+ attention) per token over the cluster's bf16 peak
};

struct LayoutPlan {
  Layout layout;
  MemoryTerms memory;
  TimeTerms time;
  bool fits = true;
  std::string why; // why the layout was refused, when it was
};

// One layout's plan. Throws naming what is wrong when the layout does not divide the model or
// the job (heads over tp, experts over ep, the batch over data-parallel ranks x microbatch,
// the sequence over cp, the stages over layers), or its world is not the cluster's.
LayoutPlan plan_layout(const TransformerShape& model, const JobShape& job, const Layout& layout,
                       const PlannerOptions& options = PlannerOptions());

// [Note: the layout search] Every layout of `world` ranks that divides the model and the job
// (tp within a node; 1F1B or Interleaved1F1B with 2 to 16 stages a rank; microbatches of 1, 2
// or 4 sequences; every context-parallel method and checkpointing policy), planned; those over
// the memory limit dropped; of the rest, each mesh and schedule once, with its fastest
// policy, microbatch and method, by tokens/s per GPU, best first. `refused` (when given)
// receives how many layouts the memory limit dropped.
std::vector<LayoutPlan> search_layouts(const TransformerShape& model, const JobShape& job,
                                       int64_t world,
                                       const PlannerOptions& options = PlannerOptions(),
                                       int64_t* refused = nullptr);

} // namespace dtensor
