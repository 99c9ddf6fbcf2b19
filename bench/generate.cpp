// Generation with the Llama-3 model (models/llama3/generate.h) on every rank as one
// tensor-parallel generator (parallelize_llama3_generator over the world; one rank: the plain
// model), greedy, with the KV cache and with full recompute (each token runs its row's whole
// sequence), alternating, --rounds times each, each timed between barriers. A Llama of --dim,
// --layers, --heads, --kv-heads, --vocab in fp32 from a fixed seed; --batch prompts of random
// tokens, of lengths --prompt down to --prompt / 2; --new tokens each (no eos). With --hf DIR
// (one rank) the model is also exported there as a Hugging Face folder, for bench/generate.py's
// transformers side. Rank 0 prints one line: RESULT {json} with the times (ms) of every round,
// the prompts, the tokens of the first cached round and the KV cache's bytes per rank.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dtensor/all.h>
#include <models/llama3.h>
#include <models/llama3/generate.h>

#include "bench_util.h"
#include "flags.h"

namespace {

struct Args {
  int64_t dim = 256, layers = 4, heads = 8, kv_heads = 4, vocab = 2048;
  int64_t batch = 4, prompt = 32, new_tokens = 64, rounds = 3;
  std::string hf;
};

Args parse(int argc, char** argv) {
  Args a;
  dtensor::cli::FlagTable("bench_generate", "bench/generate.cpp")
      .value("--dim", "model width (256)", a.dim)
      .value("--layers", "transformer blocks (4)", a.layers)
      .value("--heads", "attention heads (8)", a.heads)
      .value("--kv-heads", "key/value heads (4)", a.kv_heads)
      .value("--vocab", "vocabulary size (2048)", a.vocab)
      .value("--batch", "prompts (4)", a.batch)
      .value("--prompt", "the longest prompt's tokens; the others down to half (32)", a.prompt)
      .value("--new", "tokens generated per prompt (64)", a.new_tokens)
      .value("--rounds", "timed rounds of each way, cached and recomputed (3)", a.rounds)
      .value("--hf", "also export the model here as a Hugging Face folder (one rank)", a.hf)
      .parse(argc, argv);
  return a;
}

std::string json_rows(const std::vector<std::vector<int64_t>>& rows) {
  std::string s = "[";
  for (size_t i = 0; i < rows.size(); ++i) {
    s += i ? ",[" : "[";
    for (size_t j = 0; j < rows[i].size(); ++j) {
      s += (j ? "," : "") + std::to_string(rows[i][j]);
    }
    s += "]";
  }
  return s + "]";
}

} // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  const Args a = parse(argc, argv);
  dtensor::init_process_group();
  const int world = dtensor::get_world_size();
  const auto args = dtensor::models::Llama3Args()
                        .dim(a.dim)
                        .n_layers(a.layers)
                        .n_heads(a.heads)
                        .n_kv_heads(a.kv_heads)
                        .vocab_size(a.vocab)
                        .multiple_of(64)
                        .rope_theta(10000.0)
                        .rope_scaling(std::nullopt)
                        .max_seq_len(a.prompt + a.new_tokens);
  dtensor::models::Llama3 model(args);
  dtensor::set_rng_state({true, 1, 0});
  model->init_weights();
  if (!a.hf.empty() && world == 1) {
    dtensor::models::export_hf(dtensor::get_model_state_dict(*model), args, a.hf);
  }
  if (world > 1) {
    const auto mesh = dtensor::init_device_mesh(c10::kCPU, {world}, {"tp"});
    dtensor::models::parallelize_llama3_generator(model, mesh);
  }
  at::manual_seed(0);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t len = a.prompt - b * a.prompt / (2 * a.batch);
    const at::Tensor t = at::randint(a.vocab, {len}, at::kLong);
    prompts.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + len);
  }
  std::vector<double> cached_ms, recompute_ms;
  std::vector<std::vector<int64_t>> tokens;
  int64_t kv_bytes = 0;
  for (int64_t r = 0; r < a.rounds; ++r) {
    for (bool cache : {true, false}) {
      dtensor::barrier(dtensor::world_group());
      const auto start = std::chrono::steady_clock::now();
      const auto out = dtensor::models::generate(
          model, prompts,
          dtensor::models::GenerateOptions().max_new_tokens(a.new_tokens).kv_cache(cache));
      dtensor::barrier(dtensor::world_group());
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      (cache ? cached_ms : recompute_ms).push_back(ms);
      if (cache && r == 0) {
        tokens = out.tokens;
        kv_bytes = out.kv_cache_bytes;
      }
    }
  }
  if (dtensor::get_rank() == 0) {
    std::printf("RESULT {\"ranks\":%d,\"cached_ms\":%s,\"recompute_ms\":%s,\"prompts\":%s,"
                "\"tokens\":%s,\"kv_bytes\":%lld}\n",
                world, bench::json_list(cached_ms).c_str(), bench::json_list(recompute_ms).c_str(),
                json_rows(prompts).c_str(), json_rows(tokens).c_str(),
                static_cast<long long>(kv_bytes));
  }
  return 0;
}
