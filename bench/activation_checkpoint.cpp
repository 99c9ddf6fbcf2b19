// Training step time and peak memory of the Transformer under fully_shard with activation
// checkpointing none / full / selective: the dtensor side of bench/activation_checkpoint.py,
// which runs PyTorch FSDP2 + checkpoint_wrapper on the same model alternately with it.
// Run under torchrun. Model: models/fsdp_models.h's Transformer (PyTorch's test
// Transformer), fully_shard per block and the root over all ranks, AdamW + clip, random
// tokens [batch, seq] per rank, dropout 0.1.
// Flags: --ac none|full|selective, --dim D, --layers L, --seq S, --batch B, --steps N,
// --warmup N, --overlap on|off (FSDPModule::set_communication_overlap; default on),
// --floor: the compute floor of any FSDP step on these kernels ([Note: the compute floor]).
// Rank 0 prints "RESULT <json>": per-step times (ms) and the peak bytes allocated (net of
// frees) during one more (untimed) step beyond what lived at its start, counted by a CPU
// allocator that wraps LibTorch's (every tensor allocation of the process), and the median
// milliseconds of each phase of the timed steps ("phase_ms": zero_grad and the batch,
// forward and the loss, backward, clip, optimizer step).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <dtensor/all.h>

#include <models/fsdp_models.h>
#include <support/cpu_memory.h>

#include "flags.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string ac = "none";
  int64_t dim = 256, layers = 4, seq = 128, batch = 8;
  int64_t steps = 5, warmup = 2;
  bool overlap = true;
  bool floor = false;
};

Flags parse(int argc, char** argv) {
  Flags f;
  std::string overlap = "on";
  dtensor::cli::FlagTable("bench_activation_checkpoint", "bench/activation_checkpoint.cpp")
      .value("--ac", "activation checkpointing of each block (none)", f.ac,
             {"none", "full", "selective"})
      .value("--dim", "model width (256)", f.dim)
      .value("--layers", "transformer blocks (4)", f.layers)
      .value("--seq", "sequence length (128)", f.seq)
      .value("--batch", "sequences per rank (8)", f.batch)
      .value("--steps", "timed steps (5)", f.steps)
      .value("--warmup", "untimed steps before them (2)", f.warmup)
      .value("--overlap", "FSDP's communication overlap (on)", overlap, {"on", "off"})
      .toggle("--floor", "the compute floor: no fully_shard, forward and backward only", f.floor)
      .parse(argc, argv);
  f.overlap = overlap == "on";
  return f;
}

std::optional<dtensor::ActivationCheckpointOptions> ac_options(const std::string& mode) {
  if (mode == "full") {
    return dtensor::ActivationCheckpointOptions();
  }
  if (mode == "selective") { // torchtitan's "op" mode: matmuls and attention saved
    return dtensor::ActivationCheckpointOptions().policy(
        dtensor::save_ops({"aten::mm", "aten::addmm", "aten::bmm",
                           "aten::_scaled_dot_product_flash_attention_for_cpu"}));
  }
  return std::nullopt; // "none" (--ac takes only these three)
}

} // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  at::set_num_threads(1);
  auto& memory = dtensor::testing::CountingCPUAllocator::install();
  dtensor::init_process_group();
  const int world = dtensor::get_world_size();
  auto mesh = dtensor::init_device_mesh(c10::kCPU, {world}, {"dp"});
  const int64_t vocab = 256;
  torch::manual_seed(0);
  dtensor::models::Transformer model(dtensor::models::ModelArgs()
                                         .vocab_size(vocab)
                                         .max_seq_len(f.seq)
                                         .dim(f.dim)
                                         .n_layers(f.layers)
                                         .n_heads(4)
                                         .dropout_p(0.1)
                                         .activation_checkpoint(ac_options(f.ac)));
  // [Note: the compute floor]
  // With --floor each rank runs the same model on the same batch with no fully_shard: no
  // communication, no copy-in or copy-out, and only forward and backward (no clip, no
  // optimizer step). Every FSDP step on LibTorch's kernels does at least this work per
  // rank, PyTorch FSDP2's and dtensor's alike, so floor / PyTorch is the lowest step-time
  // ratio any FSDP implementation could reach here; the rest of a step is what an
  // implementation can make lighter.
  std::optional<dtensor::FSDPModule> root;
  if (!f.floor) {
    for (auto& layer : *model->layers) {
      dtensor::fully_shard(*layer, dtensor::FullyShardOptions().mesh(mesh));
    }
    root = dtensor::fully_shard(*model, dtensor::FullyShardOptions().mesh(mesh));
    root->set_communication_overlap(f.overlap);
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const int rank = dtensor::get_rank();
  // Per-phase milliseconds of the timed steps: zero_grad + batch, forward + loss, backward,
  // clip, optimizer step (rank 0's clock; every rank waits in the same collectives).
  std::vector<std::vector<double>> phases(5);
  bool timing = false;
  auto step = [&](int i) {
    auto t = Clock::now();
    auto lap = [&](int k) {
      const auto now = Clock::now();
      if (timing) {
        phases[k].push_back(std::chrono::duration<double, std::milli>(now - t).count());
      }
      t = now;
    };
    opt.zero_grad();
    at::manual_seed(100 + i + 7 * rank);
    auto tokens = at::randint(vocab, {f.batch, f.seq}, at::kLong);
    auto targets = at::randint(vocab, {f.batch, f.seq}, at::kLong);
    lap(0);
    auto loss = torch::nn::functional::cross_entropy(model->forward(tokens).view({-1, vocab}),
                                                     targets.view(-1));
    lap(1);
    loss.backward();
    lap(2);
    if (root) {
      root->clip_grad_norm_(1.0);
      lap(3);
      opt.step();
      lap(4);
    }
  };
  for (int i = 0; i < f.warmup; ++i) {
    step(i);
  }
  std::vector<double> ms;
  for (int i = 0; i < f.steps; ++i) {
    dtensor::barrier(dtensor::world_group());
    const auto t0 = Clock::now();
    timing = true;
    step(f.warmup + i);
    timing = false;
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  dtensor::barrier(dtensor::world_group());
  // The peak of what is allocated, net of frees (the previous step's gradients go in
  // zero_grad), above what lived at the step's start: PyTorch's side measures the same.
  const int64_t before = memory.live();
  memory.reset_peak();
  step(f.warmup + f.steps);
  const int64_t peak = memory.peak() - before;
  if (rank == 0) {
    std::string list;
    for (double m : ms) {
      list += (list.empty() ? "" : ", ") + std::to_string(m);
    }
    std::string split;
    for (const auto& p : phases) {
      std::vector<double> v = p;
      std::sort(v.begin(), v.end());
      split += (split.empty() ? "" : ", ") + std::to_string(v.empty() ? 0.0 : v[v.size() / 2]);
    }
    std::printf("RESULT {\"step_ms\": [%s], \"peak_bytes\": %lld, \"phase_ms\": [%s]}\n",
                list.c_str(), static_cast<long long>(peak), split.c_str());
    std::fflush(stdout);
  }
  return 0;
}
