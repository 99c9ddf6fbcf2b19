#pragma once

// A Llama-3 Transformer after torchtitan's models/llama3/model/{args,model}.py (RMSNorm
// pre-norm blocks, grouped-query attention with rotary embeddings and causal sdpa, SwiGLU,
// Linears without bias), with parameter names and order exactly torchtitan's; its
// init_weights() on dtensor's layout-independent random ops (after parallelize_module /
// fully_shard / to_empty); apply_tp, torchtitan's infra/parallelize.py apply_tp in dtensor's
// styles; and Hugging Face LlamaForCausalLM names and rotary layout (to_hf / from_hf). Left
// out: flex / varlen attention, positions, qk-norm, PEFT, float8, context parallel, tying.
#include <cmath>
#include <cstdint>
#include <memory>
#include <numbers>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <dtensor/activation_checkpoint.h>
#include <dtensor/device_mesh.h>
#include <dtensor/dtensor.h>
#include <dtensor/fully_shard.h>
#include <dtensor/placement.h>
#include <dtensor/random.h>
#include <dtensor/tensor_parallel.h>

#include <models/check.h>

namespace dtensor::models {

// Llama 3.1's RoPE frequency scaling (torchtitan's RoPEScalingArgs; Hugging Face's
// rope_scaling with rope_type "llama3").
struct Llama3RopeScaling {
  TORCH_ARG(double, scaling_factor) = 8.0;
  TORCH_ARG(double, low_freq_factor) = 1.0;
  TORCH_ARG(double, high_freq_factor) = 4.0;
  TORCH_ARG(int64_t, original_max_position_embeddings) = 8192;
};

// torchtitan's TransformerModelArgs; chainable: Llama3Args().dim(512).n_kv_heads(4).
// Defaults: torchtitan's "debugmodel" flavor, except max_seq_len, which torchtitan overwrites
// with the training seq_len (2048 in its debug config) in update_from_config.
struct Llama3Args {
  TORCH_ARG(int64_t, dim) = 256;
  TORCH_ARG(int64_t, n_layers) = 6;
  TORCH_ARG(int64_t, n_heads) = 16;
  TORCH_ARG(int64_t, n_kv_heads) = 0; // 0: n_heads (torchtitan's None)
  TORCH_ARG(int64_t, vocab_size) = 2048;
  TORCH_ARG(int64_t, multiple_of) = 256;
  TORCH_ARG(double, ffn_dim_multiplier) = 0.0; // 0: none (torchtitan's None)
  TORCH_ARG(double, norm_eps) = 1e-5;
  TORCH_ARG(double, rope_theta) = 500000.0;
  // torchtitan's args.py applies Llama 3.1's scaling by default; nullopt: plain RoPE (Llama 3.0).
  TORCH_ARG(std::optional<Llama3RopeScaling>, rope_scaling) = Llama3RopeScaling();
  TORCH_ARG(int64_t, max_seq_len) = 2048;
  // The feed-forward width as given (a Hugging Face config's intermediate_size); 0: computed
  // from dim, multiple_of and ffn_dim_multiplier as torchtitan.
  TORCH_ARG(int64_t, ffn_hidden) = 0;
  // Init std of wo / w2 / w3: by layer id (true) or by n_layers (false), as torchtitan.
  TORCH_ARG(bool, depth_init) = true;
  // dtensor's addition: each block's forward checkpointed with these options
  // (dtensor/activation_checkpoint.h; torchtitan's per-block activation checkpointing).
  TORCH_ARG(std::optional<dtensor::ActivationCheckpointOptions>,
            activation_checkpoint) = std::nullopt;

 public:
  int64_t kv_heads() const { return n_kv_heads() > 0 ? n_kv_heads() : n_heads(); }
  int64_t head_dim() const { return dim() / n_heads(); }
  // torchtitan's FeedForward: int(2 * (4 * dim) / 3), times ffn_dim_multiplier (truncated),
  // rounded up to a multiple of multiple_of. (8B: 4096 -> 14336.)
  int64_t ffn_hidden_dim() const {
    if (ffn_hidden() > 0) {
      return ffn_hidden();
    }
    int64_t hidden = 2 * (4 * dim()) / 3;
    if (ffn_dim_multiplier() > 0.0) {
      hidden = static_cast<int64_t>(ffn_dim_multiplier() * static_cast<double>(hidden));
    }
    return multiple_of() * ((hidden + multiple_of() - 1) / multiple_of());
  }
};

// torchtitan's "8B" flavor (max_seq_len: its llama3_8b training seq_len).
inline Llama3Args llama3_8b_args() {
  return Llama3Args()
      .dim(4096)
      .n_layers(32)
      .n_heads(32)
      .n_kv_heads(8)
      .vocab_size(128256)
      .multiple_of(1024)
      .ffn_dim_multiplier(1.3)
      .rope_theta(500000.0)
      .max_seq_len(8192);
}

// torchtitan's "70B" and "405B" flavors.
inline Llama3Args llama3_70b_args() {
  return llama3_8b_args().dim(8192).n_layers(80).n_heads(64).multiple_of(4096);
}

inline Llama3Args llama3_405b_args() {
  return llama3_8b_args()
      .dim(16384)
      .n_layers(126)
      .n_heads(128)
      .multiple_of(4096)
      .ffn_dim_multiplier(1.2);
}

// torchtitan's flavor by name ("llama3-8b", "llama3-70b", "llama3-405b"), if it is one.
inline std::optional<Llama3Args> llama3_preset(const std::string& name) {
  if (name == "llama3-8b") {
    return llama3_8b_args();
  }
  if (name == "llama3-70b") {
    return llama3_70b_args();
  }
  if (name == "llama3-405b") {
    return llama3_405b_args();
  }
  return std::nullopt;
}

// A tiny model for tests and interchange checks (dim 64, 2 layers, 4 heads, 2 kv heads, vocab
// 256, plain RoPE).
inline Llama3Args llama3_tiny_args() {
  return Llama3Args()
      .dim(64)
      .n_layers(2)
      .n_heads(4)
      .n_kv_heads(2)
      .vocab_size(256)
      .multiple_of(32)
      .rope_theta(10000.0)
      .rope_scaling(std::nullopt)
      .max_seq_len(16);
}

namespace llama3_detail {

inline torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// [Note: plain tensors next to DTensors] Under TP q and k are DTensors while the rotary
// tables come from a plain buffer (the same on every rank); dtensor takes plain tensors as
// Replicate only next to a parallelized module's own activations, so they are wrapped as
// Replicate on `like`'s mesh here (no communication). Plain `like` or DTensor `t`: `t`.
inline at::Tensor replicate_like(const at::Tensor& t, const at::Tensor& like) {
  if (!dtensor::is_dtensor(like) || dtensor::is_dtensor(t)) {
    return t;
  }
  const dtensor::DeviceMesh mesh = dtensor::DTensor(like).device_mesh();
  return dtensor::DTensor::from_local(
      t, mesh, dtensor::Placements(static_cast<size_t>(mesh.ndim()), dtensor::Replicate()),
      t.sizes().vec()); // the same buffer on every rank: no exchange of sizes needed
}

} // namespace llama3_detail

// ---------------------------------------------------------------------------------------------
// Rotary embeddings
// ---------------------------------------------------------------------------------------------

// torchtitan's apply_scaling (Llama 3.1): long wavelengths divided by scaling_factor, short
// ones kept, the band between interpolated.
inline at::Tensor apply_rope_scaling(const at::Tensor& freqs, const Llama3RopeScaling& s) {
  const double original = static_cast<double>(s.original_max_position_embeddings());
  const double low_freq_wavelen = original / s.low_freq_factor();
  const double high_freq_wavelen = original / s.high_freq_factor();
  at::Tensor wavelen = freqs.reciprocal() * (2.0 * std::numbers::pi);
  at::Tensor scaled = at::where(wavelen > low_freq_wavelen, freqs / s.scaling_factor(), freqs);
  at::Tensor smooth = (wavelen.reciprocal() * original - s.low_freq_factor()) /
                      (s.high_freq_factor() - s.low_freq_factor());
  at::Tensor band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen);
  return at::where(band, (1.0 - smooth) * scaled / s.scaling_factor() + smooth * scaled, scaled);
}

// [Note: interleaved rotary layout] torchtitan's precompute_freqs_cis as real pairs:
// [end, head_dim / 2, 2] holding (cos, sin) of t * freq_i (view_as_real of its complex64
// buffer). apply_rotary_emb reads q / k's last dim as pairs x[2i] + i x[2i+1] (Meta's layout)
// and multiplies each by cis(t * freq_i).
inline at::Tensor precompute_freqs_cis(int64_t head_dim, int64_t end, double theta,
                                       const std::optional<Llama3RopeScaling>& scaling,
                                       const at::TensorOptions& options = {}) {
  const at::TensorOptions f32 = options.dtype(at::kFloat);
  at::Tensor exponent =
      at::arange(0, head_dim, 2, f32).slice(0, 0, head_dim / 2) / static_cast<double>(head_dim);
  at::Tensor freqs = at::pow(theta, exponent).reciprocal();
  if (scaling) {
    freqs = apply_rope_scaling(freqs, *scaling);
  }
  at::Tensor angles = at::outer(at::arange(end, f32), freqs);
  return at::stack({angles.cos(), angles.sin()}, -1);
}

// The (cos, sin) tables of the first `seqlen` positions, shaped [1, seqlen, 1, head_dim / 2]
// to broadcast over [bs, seqlen, heads, head_dim / 2]; DTensors when `like` is one.
inline std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& freqs_cis, int64_t seqlen,
                                                     const at::Tensor& like) {
  at::Tensor f = freqs_cis.narrow(0, 0, seqlen).to(at::kFloat);
  const int64_t half = f.size(1);
  auto table = [&](int64_t i) {
    return llama3_detail::replicate_like(f.select(-1, i).contiguous().view({1, seqlen, 1, half}),
                                         like);
  };
  return {table(0), table(1)};
}

// torchtitan's apply_rotary_emb on one of q / k ([bs, seqlen, heads, head_dim]), in fp32, with
// real arithmetic for the complex product (x_r + i x_i)(cos + i sin).
inline at::Tensor apply_rotary_emb(const at::Tensor& x, const at::Tensor& rot_cos,
                                   const at::Tensor& rot_sin) {
  at::Tensor pairs = x.to(at::kFloat).view({x.size(0), x.size(1), x.size(2), x.size(3) / 2, 2});
  at::Tensor re = pairs.select(-1, 0);
  at::Tensor im = pairs.select(-1, 1);
  at::Tensor out =
      at::stack({re * rot_cos - im * rot_sin, re * rot_sin + im * rot_cos}, -1).flatten(3);
  return out.to(x.scalar_type());
}

// torchtitan's repeat_kv: [bs, seqlen, n_kv_heads, head_dim] -> [.., n_kv_heads * n_rep, ..],
// each kv head repeated n_rep times in place (torch.repeat_interleave on dim 2).
inline at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) {
    return x;
  }
  const int64_t bs = x.size(0), slen = x.size(1), n_kv = x.size(2), hd = x.size(3);
  return x.unsqueeze(3).expand({bs, slen, n_kv, n_rep, hd}).reshape({bs, slen, n_kv * n_rep, hd});
}

// ---------------------------------------------------------------------------------------------
// Modules
// ---------------------------------------------------------------------------------------------

// x * rsqrt(mean(x^2) + eps) computed in fp32 and cast back to x's dtype, times `weight`
// (Hugging Face's LlamaRMSNorm, torchtitan's former RMSNorm). A module of its own, not a
// Linear, so SequenceParallel accepts it.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps_)
      : eps(eps_), weight(register_parameter("weight", torch::ones({dim}))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x.to(at::kFloat);
    h = h * at::rsqrt(h.pow(2).mean({-1}, /*keepdim=*/true) + eps);
    return h.to(x.scalar_type()) * weight;
  }
  void reset_parameters() {
    torch::NoGradGuard no_grad;
    weight.fill_(1.0);
  }
  double eps;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

// Grouped-query attention: wq (dim -> n_heads * head_dim), wk / wv (-> n_kv_heads * head_dim),
// rotary q / k, kv heads repeated to n_heads, causal sdpa, wo.
struct Llama3AttentionImpl : torch::nn::Module {
  explicit Llama3AttentionImpl(const Llama3Args& args)
      : n_rep(args.n_heads() / args.kv_heads()), head_dim(args.head_dim()),
        wq(register_module("wq", llama3_detail::linear(args.dim(), args.n_heads() * head_dim))),
        wk(register_module("wk", llama3_detail::linear(args.dim(), args.kv_heads() * head_dim))),
        wv(register_module("wv", llama3_detail::linear(args.dim(), args.kv_heads() * head_dim))),
        wo(register_module("wo", llama3_detail::linear(args.n_heads() * head_dim, args.dim()))) {
    DTENSOR_MODEL_CHECK(args.dim() % args.n_heads() == 0, "Llama3: dim must be a multiple of n_heads");
    DTENSOR_MODEL_CHECK(args.n_heads() % args.kv_heads() == 0,
                "Llama3: n_heads must be a multiple of n_kv_heads");
    DTENSOR_MODEL_CHECK(head_dim % 2 == 0, "Llama3: rotary embeddings need an even head_dim");
  }
  at::Tensor forward(const at::Tensor& input, const at::Tensor& freqs_cis) {
    const at::Tensor x = dtensor::prepare_module_input(*this, input); // TP: gathered once
    const int64_t bs = x.size(0);
    const int64_t seqlen = x.size(1);
    // [Note: -1 heads] As torchtitan: -1, not n_heads / n_kv_heads, so the view also fits a
    // projection whose output is a local shard of the heads (a plain local tensor); dtensor's
    // DTensors have the global shape, where -1 gives the full count.
    at::Tensor xq = wq->forward(x).view({bs, seqlen, -1, head_dim});
    at::Tensor xk = wk->forward(x).view({bs, seqlen, -1, head_dim});
    at::Tensor xv = wv->forward(x).view({bs, seqlen, -1, head_dim});
    auto [rot_cos, rot_sin] = rope_tables(freqs_cis, seqlen, xq);
    xq = apply_rotary_emb(xq, rot_cos, rot_sin);
    xk = apply_rotary_emb(xk, rot_cos, rot_sin);
    at::Tensor keys = repeat_kv(xk, n_rep);
    at::Tensor values = repeat_kv(xv, n_rep);
    // [bs, heads, seqlen, head_dim]
    at::Tensor out = at::scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2),
                                                      values.transpose(1, 2), /*attn_mask=*/{},
                                                      /*dropout_p=*/0.0, /*is_causal=*/true);
    return wo->forward(out.transpose(1, 2).contiguous().view({bs, seqlen, -1}));
  }
  // torchtitan: wq / wk / wv trunc_normal_(std 0.02), wo trunc_normal_(init_std), both with
  // PyTorch's default bounds [-2, 2] (absolute, so hardly truncated at these stds).
  void init_weights(double init_std) {
    torch::NoGradGuard no_grad;
    for (torch::nn::Linear* l : {&wq, &wk, &wv}) {
      dtensor::trunc_normal_((*l)->weight, 0.0, 0.02);
    }
    dtensor::trunc_normal_(wo->weight, 0.0, init_std);
  }
  int64_t n_rep;
  int64_t head_dim;
  torch::nn::Linear wq;
  torch::nn::Linear wk;
  torch::nn::Linear wv;
  torch::nn::Linear wo;
};
TORCH_MODULE(Llama3Attention);

// SwiGLU: w2(silu(w1 x) * w3 x), w1 / w3 dim -> hidden_dim, w2 back.
struct Llama3FeedForwardImpl : torch::nn::Module {
  Llama3FeedForwardImpl(int64_t dim, int64_t hidden_dim)
      : w1(register_module("w1", llama3_detail::linear(dim, hidden_dim))),
        w2(register_module("w2", llama3_detail::linear(hidden_dim, dim))),
        w3(register_module("w3", llama3_detail::linear(dim, hidden_dim))) {}
  at::Tensor forward(const at::Tensor& input) {
    const at::Tensor x = dtensor::prepare_module_input(*this, input); // TP: gathered once
    return w2->forward(at::silu(w1->forward(x)) * w3->forward(x));
  }
  // torchtitan: w1 trunc_normal_(std 0.02), w2 / w3 trunc_normal_(init_std).
  void init_weights(double init_std) {
    torch::NoGradGuard no_grad;
    dtensor::trunc_normal_(w1->weight, 0.0, 0.02);
    dtensor::trunc_normal_(w2->weight, 0.0, init_std);
    dtensor::trunc_normal_(w3->weight, 0.0, init_std);
  }
  torch::nn::Linear w1;
  torch::nn::Linear w2;
  torch::nn::Linear w3;
};
TORCH_MODULE(Llama3FeedForward);

// h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h)). Submodules in
// torchtitan's order (attention, feed_forward, attention_norm, ffn_norm).
struct Llama3BlockImpl : torch::nn::Module {
  Llama3BlockImpl(int64_t layer_id, const Llama3Args& args)
      : attention(register_module("attention", Llama3Attention(args))),
        feed_forward(
            register_module("feed_forward", Llama3FeedForward(args.dim(), args.ffn_hidden_dim()))),
        attention_norm(register_module("attention_norm", RMSNorm(args.dim(), args.norm_eps()))),
        ffn_norm(register_module("ffn_norm", RMSNorm(args.dim(), args.norm_eps()))),
        weight_init_std(init_std(layer_id, args)) {}
  // torchtitan: 0.02 / sqrt(2 * (layer_id + 1)) with depth_init, else 0.02 / sqrt(2 * n_layers).
  static double init_std(int64_t layer_id, const Llama3Args& args) {
    const int64_t depth = args.depth_init() ? layer_id + 1 : args.n_layers();
    return 0.02 / std::sqrt(2.0 * static_cast<double>(depth));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& freqs_cis) {
    at::Tensor h = x + attention->forward(attention_norm->forward(x), freqs_cis);
    return h + feed_forward->forward(ffn_norm->forward(h));
  }
  void init_weights() {
    attention_norm->reset_parameters();
    ffn_norm->reset_parameters();
    attention->init_weights(weight_init_std);
    feed_forward->init_weights(weight_init_std);
  }
  Llama3Attention attention;
  Llama3FeedForward feed_forward;
  RMSNorm attention_norm;
  RMSNorm ffn_norm;
  double weight_init_std;
};
TORCH_MODULE(Llama3Block);

// forward(tokens [bs, seqlen] int64) -> logits [bs, seqlen, vocab_size] in the parameters'
// dtype, as torchtitan (its loss casts to fp32). Rotary tables: the buffer freqs_cis.
// [Note: freqs_cis is persistent] LibTorch has no persistent=False buffers: freqs_cis is in
// named_buffers() and state dicts, where torchtitan's is not; to_hf skips it.
// The constructor leaves LibTorch's default init: call init_weights() (after to_empty when
// built on the meta device, docs/meta_init.md).
struct Llama3Impl : torch::nn::Module {
  explicit Llama3Impl(const Llama3Args& args = Llama3Args())
      : model_args(args),
        tok_embeddings(
            register_module("tok_embeddings", torch::nn::Embedding(args.vocab_size(), args.dim()))),
        freqs_cis(register_buffer("freqs_cis", compute_freqs_cis({}))),
        layers(register_module("layers", torch::nn::ModuleList())) {
    for (int64_t i = 0; i < args.n_layers(); ++i) {
      layers->push_back(Llama3Block(i, args));
    }
    norm = register_module("norm", RMSNorm(args.dim(), args.norm_eps()));
    output = register_module("output", llama3_detail::linear(args.dim(), args.vocab_size()));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    DTENSOR_MODEL_CHECK(tokens.size(1) <= freqs_cis.size(0), "Llama3: sequence of ", tokens.size(1),
                " tokens is longer than max_seq_len ", freqs_cis.size(0));
    at::Tensor h = tok_embeddings->forward(tokens);
    for (const auto& layer : *layers) {
      auto* block = layer->as<Llama3BlockImpl>();
      h = model_args.activation_checkpoint()
              ? dtensor::activation_checkpoint(
                    [block, f = freqs_cis](const at::Tensor& x) { return block->forward(x, f); }, h,
                    *model_args.activation_checkpoint())
              : block->forward(h, freqs_cis);
    }
    // TP: the final norm's sequence shards gathered for `output` above autograd, so their
    // gradient is reduce-scattered once ([Note: module inputs without hooks]).
    return output->forward(dtensor::prepare_module_input(*output, norm->forward(h)));
  }
  // torchtitan's Transformer.init_weights: freqs_cis recomputed, tok_embeddings normal (std 1),
  // the blocks', norm one, output truncated normal (std dim^-0.5, within 3 std). Every value
  // from dtensor's random ops (docs/random.md) or a constant, in a fixed order: the same full
  // values on every layout (plain, TP, FSDP, both) for the same seed.
  void init_weights() {
    torch::NoGradGuard no_grad;
    freqs_cis.copy_(llama3_detail::replicate_like(
        compute_freqs_cis(at::TensorOptions().device(freqs_cis.device())), freqs_cis));
    dtensor::normal_(tok_embeddings->weight, 0.0, 1.0);
    for (const auto& layer : *layers) {
      layer->as<Llama3BlockImpl>()->init_weights();
    }
    norm->reset_parameters();
    const double final_out_std = 1.0 / std::sqrt(static_cast<double>(model_args.dim()));
    dtensor::trunc_normal_(output->weight, 0.0, final_out_std, -3.0 * final_out_std,
                           3.0 * final_out_std);
  }
  at::Tensor compute_freqs_cis(const at::TensorOptions& options) const {
    return precompute_freqs_cis(model_args.head_dim(), model_args.max_seq_len(),
                                model_args.rope_theta(), model_args.rope_scaling(), options);
  }

  Llama3Args model_args;
  torch::nn::Embedding tok_embeddings;
  at::Tensor freqs_cis;
  torch::nn::ModuleList layers;
  RMSNorm norm{nullptr};
  torch::nn::Linear output{nullptr};
};
TORCH_MODULE(Llama3);

// ---------------------------------------------------------------------------------------------
// Tensor parallelism: torchtitan's apply_tp
// ---------------------------------------------------------------------------------------------

// torchtitan's apply_tp as one plan (no Float8, no context parallel): tok_embeddings row-wise
// to Shard(1), so the residual stream is sequence-sharded between blocks; the norms
// SequenceParallel; attention / feed_forward gather their Shard(1) input once
// (PrepareModuleInput, which their forward applies: [Note: module inputs without hooks]);
// wq / wk / wv / w1 / w3 column-wise; wo / w2 row-wise, reduce-scattered to Shard(1); output
// column-wise from Shard(1), to Shard(-1) DTensor logits with loss_parallel (for
// dtensor::LossParallel), else Replicate.
inline dtensor::ParallelizePlan llama3_tp_plan(bool loss_parallel) {
  using dtensor::ColwiseParallel;
  using dtensor::Replicate;
  using dtensor::RowwiseParallel;
  using dtensor::SequenceParallel;
  using dtensor::Shard;
  auto style = [](auto s) -> std::shared_ptr<dtensor::ParallelStyle> {
    return std::make_shared<decltype(s)>(std::move(s));
  };
  const auto gathered =
      dtensor::PrepareModuleInput().input_layouts(Shard(1)).desired_input_layouts(Replicate());
  const auto scattered = RowwiseParallel().output_layouts(Shard(1));
  return {
      {"tok_embeddings",
       style(RowwiseParallel().input_layouts(Replicate()).output_layouts(Shard(1)))},
      {"norm", style(SequenceParallel())},
      // Replicate logits (loss_parallel off) are gathered as they leave `output`
      // (test_llama3 checks them against the plain model's).
      {"output", style(ColwiseParallel()
                           .input_layouts(Shard(1))
                           .output_layouts(loss_parallel ? Shard(-1) : Replicate())
                           .use_local_output(!loss_parallel))},
      {"layers.*.attention_norm", style(SequenceParallel())},
      {"layers.*.attention", style(gathered)},
      {"layers.*.attention.w[qkv]", style(ColwiseParallel())},
      {"layers.*.attention.wo", style(scattered)},
      {"layers.*.ffn_norm", style(SequenceParallel())},
      {"layers.*.feed_forward", style(gathered)},
      {"layers.*.feed_forward.w[13]", style(ColwiseParallel())},
      {"layers.*.feed_forward.w2", style(scattered)},
  };
}

// Parallelizes `model` over the 1-D tp_mesh (collective: every rank of tp_mesh calls it).
// Heads are sharded: n_heads and n_kv_heads must be multiples of the mesh size, so that
// repeat_kv's local kv heads are those of the local q heads. freqs_cis stays a plain buffer
// ([Note: plain tensors next to DTensors]).
inline void apply_tp(Llama3& model, const dtensor::DeviceMesh& tp_mesh, bool loss_parallel) {
  const Llama3Args& a = model->model_args;
  DTENSOR_MODEL_CHECK(a.n_heads() % tp_mesh.size() == 0 && a.kv_heads() % tp_mesh.size() == 0,
              "Llama3 apply_tp: n_heads (", a.n_heads(), ") and n_kv_heads (", a.kv_heads(),
              ") must be multiples of the tensor-parallel degree ", tp_mesh.size());
  dtensor::parallelize_module(*model, tp_mesh, llama3_tp_plan(loss_parallel));
}

// torchtitan's parallelize_llama on a 3-D mesh named (dp_replicate, dp_shard, tp): apply_tp
// over tp, then fully_shard on each block and on the root over (dp_replicate, dp_shard) (HSDP
// when dp_replicate > 1). Mixed precision and activation checkpointing come from `fsdp` and
// the model's own arguments. Collective.
inline void parallelize_llama3(Llama3& model, const dtensor::DeviceMesh& mesh, bool loss_parallel,
                               const dtensor::FullyShardOptions& fsdp = {}) {
  apply_tp(model, mesh["tp"], loss_parallel);
  auto options = fsdp;
  options.mesh(mesh[{"dp_replicate", "dp_shard"}]);
  for (auto& layer : *model->layers) {
    dtensor::fully_shard(*layer, options);
  }
  dtensor::fully_shard(*model, options);
}

// ---------------------------------------------------------------------------------------------
// Hugging Face exchange (names and layouts only; full tensors, no I/O)
// ---------------------------------------------------------------------------------------------

// (ours, Hugging Face's) for the parameters of block i, below "layers.{i}." and
// "model.layers.{i}." (convert_llama_weights_to_hf.py, torchtitan's Llama3StateDictAdapter).
inline const std::vector<std::pair<std::string, std::string>>& hf_block_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"attention.wq.weight", "self_attn.q_proj.weight"},
      {"attention.wk.weight", "self_attn.k_proj.weight"},
      {"attention.wv.weight", "self_attn.v_proj.weight"},
      {"attention.wo.weight", "self_attn.o_proj.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
      {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"},
      {"attention_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
  };
  return names;
}

inline const std::vector<std::pair<std::string, std::string>>& hf_top_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"tok_embeddings.weight", "model.embed_tokens.weight"},
      {"norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  return names;
}

namespace llama3_detail {

// `name` mapped by the tables: top-level names directly, "<from_prefix>{i}.<rest>" to
// "<to_prefix>{i}.<rest mapped>"; nullopt when nothing matches. `forward` picks the direction.
inline std::optional<std::string> map_name(const std::string& name, bool forward) {
  for (const auto& [ours, hf] : hf_top_names()) {
    if (name == (forward ? ours : hf)) {
      return forward ? hf : ours;
    }
  }
  const std::string from_prefix = forward ? "layers." : "model.layers.";
  const std::string to_prefix = forward ? "model.layers." : "layers.";
  if (name.rfind(from_prefix, 0) != 0) {
    return std::nullopt;
  }
  const size_t dot = name.find('.', from_prefix.size());
  if (dot == std::string::npos) {
    return std::nullopt;
  }
  const std::string index = name.substr(from_prefix.size(), dot - from_prefix.size());
  const std::string rest = name.substr(dot + 1);
  for (const auto& [ours, hf] : hf_block_names()) {
    if (rest == (forward ? ours : hf)) {
      return to_prefix + index + "." + (forward ? hf : ours);
    }
  }
  return std::nullopt;
}

} // namespace llama3_detail

// Our parameter name -> LlamaForCausalLM's ("layers.3.attention.wq.weight" ->
// "model.layers.3.self_attn.q_proj.weight"). Throws for names without one (freqs_cis).
inline std::string hf_name(const std::string& ours) {
  std::optional<std::string> hf = llama3_detail::map_name(ours, /*forward=*/true);
  DTENSOR_MODEL_CHECK(hf.has_value(), "hf_name: no Hugging Face name for '", ours, "'");
  return *hf;
}

// LlamaForCausalLM's parameter name -> ours. Throws for names without one.
inline std::string from_hf_name(const std::string& hf) {
  std::optional<std::string> ours = llama3_detail::map_name(hf, /*forward=*/false);
  DTENSOR_MODEL_CHECK(ours.has_value(), "from_hf_name: no Llama3 name for '", hf, "'");
  return *ours;
}

// [Note: Hugging Face rotary layout] Hugging Face's rotate_half pairs feature i of a head with
// i + head_dim / 2, not 2i with 2i+1 ([Note: interleaved rotary layout]). to_hf_qk is
// convert_llama_weights_to_hf.py's permute (rows [n_heads, head_dim / 2, 2] -> [n_heads, 2,
// head_dim / 2]), from_hf_qk its inverse; `n_heads`: n_heads for wq, n_kv_heads for wk.
// Full (unsharded) weights [n_heads * head_dim, dim].
inline at::Tensor to_hf_qk(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  DTENSOR_MODEL_CHECK(rows % (2 * n_heads) == 0, "to_hf_qk: ", rows, " rows are not ", n_heads,
              " heads of even size");
  return w.reshape({n_heads, rows / n_heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols});
}

inline at::Tensor from_hf_qk(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0), cols = w.size(1);
  DTENSOR_MODEL_CHECK(rows % (2 * n_heads) == 0, "from_hf_qk: ", rows, " rows are not ", n_heads,
              " heads of even size");
  return w.reshape({n_heads, 2, rows / n_heads / 2, cols}).transpose(1, 2).reshape({rows, cols});
}

// One entry of our state dict as Hugging Face's (name, tensor): wq / wk permuted, the rest as
// is; nullopt for freqs_cis ([Note: freqs_cis is persistent]). Full tensors.
inline std::optional<std::pair<std::string, at::Tensor>>
to_hf(const std::string& name, const at::Tensor& t, const Llama3Args& args) {
  if (name == "freqs_cis") {
    return std::nullopt;
  }
  at::Tensor v = t;
  if (llama3_detail::ends_with(name, ".attention.wq.weight")) {
    v = to_hf_qk(t, args.n_heads());
  } else if (llama3_detail::ends_with(name, ".attention.wk.weight")) {
    v = to_hf_qk(t, args.kv_heads());
  }
  return std::make_pair(hf_name(name), v);
}

// One entry of a Hugging Face state dict as ours; nullopt for rotary_emb.inv_freq (older
// checkpoints' buffer, dropped as torchtitan's adapter does).
inline std::optional<std::pair<std::string, at::Tensor>>
from_hf(const std::string& hf, const at::Tensor& t, const Llama3Args& args) {
  if (llama3_detail::ends_with(hf, ".self_attn.rotary_emb.inv_freq")) {
    return std::nullopt;
  }
  at::Tensor v = t;
  if (llama3_detail::ends_with(hf, ".self_attn.q_proj.weight")) {
    v = from_hf_qk(t, args.n_heads());
  } else if (llama3_detail::ends_with(hf, ".self_attn.k_proj.weight")) {
    v = from_hf_qk(t, args.kv_heads());
  }
  return std::make_pair(from_hf_name(hf), v);
}

} // namespace dtensor::models
