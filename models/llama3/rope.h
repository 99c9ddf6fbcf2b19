#pragma once

// Rotary embeddings of the Llama-3 family: torchtitan's precompute_freqs_cis (Llama 3.1's
// scaling, or YaRN's as DeepSeek-V3 uses it) as real (cos, sin) pairs, and apply_rotary_emb.
#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>

#include <models/llama3/args.h>

namespace dtensor::models {

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

// YaRN's get_mscale: 0.1 m ln(s) + 1 above a factor of 1, else 1.
inline double yarn_mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

// Hugging Face's _compute_yarn_parameters: the frequencies of `dim` rotary features (in its
// operation order, for bit-equal float32) and the factor cos / sin are multiplied by.
inline std::pair<at::Tensor, double> yarn_frequencies(int64_t dim, double base, const YarnRope& y,
                                                      const at::TensorOptions& f32) {
  const double attention_factor =
      y.mscale() != 0.0 && y.mscale_all_dim() != 0.0
          ? yarn_mscale(y.factor(), y.mscale()) / yarn_mscale(y.factor(), y.mscale_all_dim())
          : yarn_mscale(y.factor(), 1.0);
  at::Tensor pos_freqs = at::pow(base, at::arange(0, dim, 2, f32) / static_cast<double>(dim));
  at::Tensor extrapolation = pos_freqs.reciprocal();
  at::Tensor interpolation = (pos_freqs * y.factor()).reciprocal();
  const auto correction = [&](double rotations) {
    return static_cast<double>(dim) *
           std::log(static_cast<double>(y.original_max_position_embeddings()) /
                    (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(base));
  };
  const double low = std::max(std::floor(correction(y.beta_fast())), 0.0);
  double high = std::min(std::ceil(correction(y.beta_slow())), static_cast<double>(dim - 1));
  if (low == high) {
    high += 0.001;
  }
  at::Tensor ramp = ((at::arange(dim / 2, f32) - low) / (high - low)).clamp(0, 1);
  at::Tensor extrapolation_factor = 1 - ramp;
  at::Tensor freqs =
      interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
  return {freqs, attention_factor};
}

// [Note: interleaved rotary layout] torchtitan's precompute_freqs_cis as real pairs:
// [end, head_dim / 2, 2] holding (cos, sin) of t * freq_i (view_as_real of its complex64
// buffer). apply_rotary_emb reads q / k's last dim as pairs x[2i] + i x[2i+1] (Meta's layout)
// and multiplies each by cis(t * freq_i). With YaRN the frequencies are its own and cos / sin
// are multiplied by its attention factor (Hugging Face's attention_scaling).
inline at::Tensor precompute_freqs_cis(int64_t head_dim, int64_t end, double theta,
                                       const std::optional<Llama3RopeScaling>& scaling,
                                       const at::TensorOptions& options = {},
                                       const std::optional<YarnRope>& yarn = std::nullopt) {
  const at::TensorOptions f32 = options.dtype(at::kFloat);
  at::Tensor freqs;
  double magnitude = 1.0;
  if (yarn) {
    std::tie(freqs, magnitude) = yarn_frequencies(head_dim, theta, *yarn, f32);
  } else {
    at::Tensor exponent =
        at::arange(0, head_dim, 2, f32).slice(0, 0, head_dim / 2) / static_cast<double>(head_dim);
    freqs = at::pow(theta, exponent).reciprocal();
    if (scaling) {
      freqs = apply_rope_scaling(freqs, *scaling);
    }
  }
  at::Tensor angles = at::outer(at::arange(end, f32), freqs);
  at::Tensor table = at::stack({angles.cos(), angles.sin()}, -1);
  return magnitude == 1.0 ? table : table * magnitude;
}

// The (cos, sin) tables of the first `seqlen` positions, shaped [1, seqlen, 1, head_dim / 2]
// to broadcast over [bs, seqlen, heads, head_dim / 2]. (Under tensor parallelism freqs_cis
// arrives as a Replicate DTensor, next to q / k sharded by heads: the style's
// more_input_layouts in models/llama3/parallelize.h.)
inline std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& freqs_cis, int64_t seqlen) {
  at::Tensor f = freqs_cis.narrow(0, 0, seqlen).to(at::kFloat);
  const int64_t half = f.size(1);
  auto table = [&](int64_t i) { return f.select(-1, i).contiguous().view({1, seqlen, 1, half}); };
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

} // namespace dtensor::models
