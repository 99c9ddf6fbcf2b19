#pragma once

// DeepSeek-V3's multi-head latent attention (torchtitan's models/deepseek_v3 Attention, with
// its module names; Hugging Face's DeepseekV3Attention).
//
// [Note: latent attention] q = wq_b(q_norm(wq_a(x))) (or wq(x) without a q latent), viewed as
// heads of [nope | rope]; the k / v latent and one rotary key come from wkv_a(x) = [latent |
// k_pe]; k / v = wkv_b(kv_norm(latent)) as heads of [k_nope | v]; k_pe, rotated once, is every
// head's rotary part of k. Causal attention with the softmax scale (qk_head_dim^-1/2, times
// YaRN's mscale^2), then wo. The rotary pairs are (2i, 2i+1), torchtitan's and the original
// checkpoint's layout: Hugging Face's rope_interleave rotates the same pairs and writes them
// out half-split, the same permutation for q and k, so the scores and the weights are the
// same (no weight is permuted on the way in or out).
#include <cmath>
#include <cstdint>
#include <numbers>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <dtensor/module_hooks.h>
#include <dtensor/random.h>

#include <models/check.h>
#include <models/llama3/args.h>
#include <models/llama3/documents.h>
#include <models/llama3/layers.h>
#include <models/llama3/rope.h>

namespace dtensor::models {

// Causal attention of q / k / v [bs, heads, seqlen, qk_head_dim], softmax scale 1/sqrt of the
// width: a module without parameters, as Llama3InnerAttention, so that context parallelism
// replaces it from outside (apply_cp in models/llama3/parallelize.h). MLAttention hands it q
// scaled to its own softmax scale and v padded to q's width (see forward).
struct MLAInnerAttentionImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return document_attention(q, k, v, documents.get());
  }
  DocumentsPtr documents; // the model's, set per step ([Note: document masks])
};
TORCH_MODULE(MLAInnerAttention);

// [Note: latent attention]. Parameters in torchtitan's order and names: wq or (wq_a, q_norm,
// wq_b), wkv_a, kv_norm, wkv_b, wo.
struct MLAttentionImpl : torch::nn::Module {
  explicit MLAttentionImpl(const Llama3Args& args) : a(*args.mla()), n_heads(args.n_heads()) {
    const int64_t dim = args.dim();
    if (a.q_lora_rank() == 0) {
      wq = register_module("wq", llama3_detail::linear(dim, n_heads * a.qk_head_dim()));
    } else {
      wq_a = register_module("wq_a", llama3_detail::linear(dim, a.q_lora_rank()));
      q_norm = register_module("q_norm", RMSNorm(a.q_lora_rank(), a.latent_norm_eps()));
      wq_b = register_module("wq_b",
                             llama3_detail::linear(a.q_lora_rank(), n_heads * a.qk_head_dim()));
    }
    wkv_a = register_module("wkv_a",
                            llama3_detail::linear(dim, a.kv_lora_rank() + a.qk_rope_head_dim()));
    kv_norm = register_module("kv_norm", RMSNorm(a.kv_lora_rank(), a.latent_norm_eps()));
    wkv_b = register_module(
        "wkv_b",
        llama3_detail::linear(a.kv_lora_rank(), n_heads * (a.qk_nope_head_dim() + a.v_head_dim())));
    wo = register_module("wo", llama3_detail::linear(n_heads * a.v_head_dim(), dim));
    if (args.yarn() && args.yarn()->mscale_all_dim() != 0.0) {
      const double m = yarn_mscale(args.yarn()->factor(), args.yarn()->mscale_all_dim());
      q_scale = m * m;
    }
    inner_attention = register_module("inner_attention", MLAInnerAttention());
    DTENSOR_MODEL_CHECK(a.qk_rope_head_dim() % 2 == 0,
                        "MLA: rotary embeddings need an even qk_rope_head_dim");
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& freqs_cis) {
    const int64_t bs = x.size(0);
    const int64_t seqlen = x.size(1);
    const int64_t nope = a.qk_nope_head_dim(), rope = a.qk_rope_head_dim();
    at::Tensor q = wq ? dtensor::call(wq, x)
                      : dtensor::call(wq_b, dtensor::call(q_norm, dtensor::call(wq_a, x)));
    q = q.view({bs, seqlen, -1, a.qk_head_dim()}); // [Note: -1 heads] in model.h
    auto [rot_cos, rot_sin] = rope_tables(freqs_cis, seqlen);
    q = at::cat(
        {q.narrow(-1, 0, nope), apply_rotary_emb(q.narrow(-1, nope, rope), rot_cos, rot_sin)}, -1);
    at::Tensor latent = dtensor::call(wkv_a, x);
    at::Tensor k_pe =
        apply_rotary_emb(latent.narrow(-1, a.kv_lora_rank(), rope).unsqueeze(2), rot_cos, rot_sin);
    at::Tensor kv =
        dtensor::call(wkv_b, dtensor::call(kv_norm, latent.narrow(-1, 0, a.kv_lora_rank())))
            .view({bs, seqlen, -1, nope + a.v_head_dim()});
    at::Tensor k_nope = kv.narrow(-1, 0, nope);
    at::Tensor k = at::cat({k_nope, k_pe.expand({bs, seqlen, k_nope.size(2), rope})}, -1);
    at::Tensor v = kv.narrow(-1, nope, a.v_head_dim());
    // [Note: the kernel's form] The softmax scale beyond 1/sqrt(qk_head_dim) (YaRN's mscale^2)
    // goes into q, and v is padded with zeros to q's width, as torchtitan pads it: the kernel
    // (and context parallelism's, which replaces it) is plain attention of one head width.
    // The zero columns come out zero and are cut off.
    if (q_scale != 1.0) {
      q = q * q_scale;
    }
    const int64_t dqk = a.qk_head_dim(), dv = a.v_head_dim();
    if (dv != dqk) {
      v = at::constant_pad_nd(v, {0, dqk - dv}, 0.0);
    }
    at::Tensor out =
        dtensor::call(inner_attention, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2));
    if (dv != dqk) {
      out = out.narrow(-1, 0, dv);
    }
    return dtensor::call(wo, out.transpose(1, 2).contiguous().view({bs, seqlen, -1}));
  }
  // torchtitan's: the projections trunc_normal_(std 0.02), wo trunc_normal_(init_std), the
  // norms one.
  void init_weights(double init_std) {
    torch::NoGradGuard no_grad;
    for (torch::nn::Linear* l : {&wq, &wq_a, &wq_b, &wkv_a, &wkv_b}) {
      if (*l) {
        dtensor::trunc_normal_((*l)->weight, 0.0, 0.02);
      }
    }
    dtensor::trunc_normal_(wo->weight, 0.0, init_std);
    if (q_norm) {
      q_norm->reset_parameters();
    }
    kv_norm->reset_parameters();
  }
  MLAArgs a;
  int64_t n_heads;
  double q_scale = 1.0;          // the softmax scale over 1/sqrt(qk_head_dim)
  torch::nn::Linear wq{nullptr}; // without a q latent
  torch::nn::Linear wq_a{nullptr};
  RMSNorm q_norm{nullptr};
  torch::nn::Linear wq_b{nullptr};
  torch::nn::Linear wkv_a{nullptr};
  RMSNorm kv_norm{nullptr};
  torch::nn::Linear wkv_b{nullptr};
  torch::nn::Linear wo{nullptr};
  MLAInnerAttention inner_attention{nullptr};
};
TORCH_MODULE(MLAttention);

} // namespace dtensor::models
