#pragma once

// Text generation with the Llama-3 family (Llama, Qwen3, their mixture-of-experts forms):
// batched requests of different lengths, a KV cache ([Note: the KV cache] in
// models/llama3/kv_cache.h), greedy or temperature / top-p sampling from a seed, stopping at an
// end-of-sequence token. Nothing here names a parallelism: on a model parallelized by
// parallelize_llama3_generator (models/llama3/parallelize.h) every rank of the tensor-parallel
// group runs the same loop on the same logits and draws the same tokens. docs/generate.md.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/arg.h>
#include <torch/utils.h>

#include <dtensor/module_hooks.h>

#include <models/check.h>
#include <models/llama3/model.h>

namespace dtensor::models {

struct GenerateOptions {
  TORCH_ARG(int64_t, max_new_tokens) = 32;
  // 0: greedy (the most likely token); else the logits are divided by it before sampling.
  TORCH_ARG(double, temperature) = 0.0;
  // Nucleus sampling: the smallest set of most likely tokens whose probability reaches top_p
  // (1: every token), as Hugging Face's TopPLogitsWarper.
  TORCH_ARG(double, top_p) = 1.0;
  // The sampler's generator (a CPU one, so every rank and device draws the same tokens).
  TORCH_ARG(uint64_t, seed) = 0;
  // A row stops after producing it (kept in its output).
  TORCH_ARG(std::optional<int64_t>, eos_id) = std::nullopt;
  // Tokens at or past it (a vocabulary padded beyond the tokenizer's) are never chosen; 0: none.
  TORCH_ARG(int64_t, vocab_size) = 0;
  // false: no cache, each token recomputes its row's whole prefix (the reference decode).
  TORCH_ARG(bool, kv_cache) = true;
};

struct GenerateResult {
  std::vector<std::vector<int64_t>> tokens; // each request's new tokens (its eos included)
  int64_t forwards = 0;                     // model forwards run
  int64_t kv_cache_bytes = 0;               // the cache this process held at the end
};

namespace generate_detail {

// The next token of each row of logits [batch, vocab] (fp32): greedy, or Hugging Face's sampling
// (temperature, then top-p, then one multinomial draw per row from `gen`).
inline at::Tensor next_tokens(at::Tensor logits, const GenerateOptions& o, at::Generator& gen) {
  if (o.vocab_size() > 0 && o.vocab_size() < logits.size(-1)) {
    logits = logits.narrow(-1, 0, o.vocab_size());
  }
  logits = logits.to(at::kCPU, at::kFloat);
  if (o.temperature() == 0.0) {
    return logits.argmax(-1);
  }
  at::Tensor scores = logits / o.temperature();
  if (o.top_p() < 1.0) {
    auto [sorted, order] = scores.sort(/*dim=*/-1, /*descending=*/false);
    at::Tensor drop = sorted.softmax(-1).cumsum(-1) <= (1.0 - o.top_p());
    drop.select(-1, -1).fill_(false); // the most likely token stays
    scores =
        scores.masked_fill(drop.scatter(-1, order, drop), -std::numeric_limits<float>::infinity());
  }
  return at::multinomial(scores.softmax(-1), 1, /*replacement=*/false, gen).squeeze(-1);
}

inline void check(const Llama3& model, const std::vector<std::vector<int64_t>>& prompts,
                  const GenerateOptions& o) {
  const Llama3Args& a = model->model_args;
  DTENSOR_MODEL_CHECK(!prompts.empty(), "generate: no prompts");
  DTENSOR_MODEL_CHECK(
      o.max_new_tokens() >= 1 && o.temperature() >= 0.0 && o.top_p() > 0.0 && o.top_p() <= 1.0,
      "generate: max_new_tokens ", o.max_new_tokens(), " (at least 1), temperature ",
      o.temperature(), " (0 or more), top_p ", o.top_p(), " (in (0, 1])");
  for (size_t b = 0; b < prompts.size(); ++b) {
    const auto len = static_cast<int64_t>(prompts[b].size());
    DTENSOR_MODEL_CHECK(len >= 1, "generate: prompt ", b, " is empty");
    DTENSOR_MODEL_CHECK(len + o.max_new_tokens() - 1 <= a.max_seq_len(), "generate: prompt ", b,
                        " of ", len, " tokens and ", o.max_new_tokens(),
                        " new ones exceed max_seq_len ", a.max_seq_len());
    for (int64_t t : prompts[b]) {
      DTENSOR_MODEL_CHECK(t >= 0 && t < a.vocab_size(), "generate: prompt ", b, " has token ", t,
                          " outside the vocabulary of ", a.vocab_size());
    }
  }
  DTENSOR_MODEL_CHECK(!a.mla() || !o.kv_cache(),
                      "generate: multi-head latent attention has no KV cache (kv_cache(false))");
}

// Rows of `rows` right-padded (with their first token) to the longest: [batch, longest] int64.
inline at::Tensor padded(const std::vector<std::vector<int64_t>>& rows, const at::Device& device) {
  size_t longest = 0;
  for (const auto& r : rows) {
    longest = std::max(longest, r.size());
  }
  std::vector<int64_t> flat;
  for (const auto& r : rows) {
    flat.insert(flat.end(), r.begin(), r.end());
    flat.insert(flat.end(), longest - r.size(), r.front());
  }
  return at::tensor(flat, at::kLong)
      .view({static_cast<int64_t>(rows.size()), static_cast<int64_t>(longest)})
      .to(device);
}

// Each row's logits at its own column (`last`): [batch, vocab].
inline at::Tensor at_columns(const at::Tensor& logits, const std::vector<int64_t>& last) {
  const at::Tensor index = at::tensor(last, at::kLong).to(logits.device());
  return logits.gather(1, index.view({-1, 1, 1}).expand({-1, 1, logits.size(2)})).squeeze(1);
}

} // namespace generate_detail

// Generates up to max_new_tokens tokens after each prompt (token ids), the requests batched.
// With the KV cache: one prefill of the prompts (right-padded to the longest), then one forward
// of one token a row per step, every row at its own position; without: each step runs the
// rows' whole sequences. Rows that produced eos_id stop (the others go on); the loop ends when
// every row has stopped or made max_new_tokens. On a tensor-parallel generator every rank of
// the group calls it with the same prompts and options (collective: the model's collectives).
inline GenerateResult generate(Llama3& model, const std::vector<std::vector<int64_t>>& prompts,
                               const GenerateOptions& o = {}) {
  generate_detail::check(model, prompts, o);
  torch::NoGradGuard no_grad;
  const auto batch = static_cast<int64_t>(prompts.size());
  const at::Device device = model->freqs_cis.device();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed());
  std::vector<std::vector<int64_t>> seqs = prompts;
  GenerateResult result;
  result.tokens.resize(static_cast<size_t>(batch));
  std::vector<bool> done(static_cast<size_t>(batch), false);
  KvCache& cache = *model->kv_cache;
  if (o.kv_cache()) {
    int64_t longest = 0;
    for (const auto& p : prompts) {
      longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
    }
    cache.reset(batch, longest + o.max_new_tokens() - 1, model->model_args.n_layers());
  }
  for (int64_t step = 0; step < o.max_new_tokens(); ++step) {
    std::vector<int64_t> last; // each row's column of its next-token logits
    at::Tensor input;
    if (o.kv_cache() && step > 0) {
      std::vector<int64_t> newest;
      for (size_t b = 0; b < seqs.size(); ++b) {
        cache.positions[b] = static_cast<int64_t>(seqs[b].size()) - 1;
        newest.push_back(seqs[b].back());
      }
      input = at::tensor(newest, at::kLong).view({batch, 1}).to(device);
      last.assign(static_cast<size_t>(batch), 0);
    } else {
      input = generate_detail::padded(seqs, device);
      for (const auto& s : seqs) {
        last.push_back(static_cast<int64_t>(s.size()) - 1);
      }
    }
    const at::Tensor logits = dtensor::call(*model, input);
    ++result.forwards;
    const at::Tensor next = generate_detail::next_tokens(generate_detail::at_columns(logits, last),
                                                         o, gen); // every row draws (HF's order)
    bool all_done = true;
    for (size_t b = 0; b < seqs.size(); ++b) {
      if (!done[b]) {
        const int64_t token = next[static_cast<int64_t>(b)].item<int64_t>();
        seqs[b].push_back(token);
        result.tokens[b].push_back(token);
        done[b] = o.eos_id() && token == *o.eos_id();
      }
      all_done = all_done && done[b];
    }
    if (all_done) {
      break;
    }
  }
  result.kv_cache_bytes = cache.bytes();
  cache.clear();
  return result;
}

} // namespace dtensor::models
