// Vocabulary parallelism in a tensor-parallel training step: bytes moved and peak memory with
// LossParallel on and off. Run under torchrun (all ranks form the tp mesh).
// Model: models/fsdp_models.h's Transformer, no dropout, untied output; plan: embeddings
// RowwiseParallel (vocab-sharded tables, masked lookups), attention / MLP projections
// colwise / rowwise, output ColwiseParallel (logits Shard(-1) on the vocabulary), every
// output a DTensor; SGD. Each step: cross_entropy on the logits viewed [batch x seq, vocab], under
// LossParallel or not (then the logits are gathered: an all-gather of N x vocab).
// Flags: --vocab V (32000), --dim D (256), --layers L (2), --seq S (128), --batch B (4),
// --steps N (3), --warmup N (1).
// Prints one Markdown row per mode (rank 0): ranks, mode, collectives and the bytes of their
// outputs per step (CommDebugMode), the peak CPU bytes allocated during a step above its start
// (a counting allocator around LibTorch's), median step time, and the loss (equal in both
// modes up to rounding).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <dtensor/all.h>

#include <models/fsdp_models.h>
#include <support/cpu_memory.h>

#include "flags.h"

namespace {

struct Flags {
  int64_t vocab = 32000, dim = 256, layers = 2, seq = 128, batch = 4;
  int64_t steps = 3, warmup = 1;
};

Flags parse(int argc, char** argv) {
  Flags f;
  dtensor::cli::FlagTable("bench_loss_parallel", "bench/loss_parallel.cpp")
      .value("--vocab", "vocabulary size (32000)", f.vocab)
      .value("--dim", "model width (256)", f.dim)
      .value("--layers", "transformer blocks (2)", f.layers)
      .value("--seq", "sequence length (128)", f.seq)
      .value("--batch", "sequences per step (4)", f.batch)
      .value("--steps", "timed steps (3)", f.steps)
      .value("--warmup", "untimed steps before them (1)", f.warmup)
      .parse(argc, argv);
  return f;
}

struct Measured {
  int64_t collectives = 0, all_gathers = 0, bytes_in = 0, peak = 0;
  double ms = 0, loss = 0;
};

Measured run(const Flags& f, const dtensor::DeviceMesh& tp, bool loss_parallel,
             dtensor::testing::CountingCPUAllocator& memory) {
  torch::manual_seed(0);
  dtensor::models::Transformer model(dtensor::models::ModelArgs()
                                         .vocab_size(f.vocab)
                                         .max_seq_len(f.seq)
                                         .dim(f.dim)
                                         .n_layers(f.layers)
                                         .n_heads(4)
                                         .dropout_p(0.0)
                                         .weight_tying(false));
  // test/support/transformer_tp.h's plan (every output a DTensor) with the output projection
  // column-wise: its logits stay Shard(-1), the vocabulary.
  const auto embedding = dtensor::RowwiseParallel()
                             .input_layouts(dtensor::Placement::replicate())
                             .use_local_output(false);
  dtensor::parallelize_module(
      *model, tp,
      dtensor::ParallelizePlan{
          {"tok_embeddings", embedding},
          {"pos_embeddings", embedding},
          {"layers.*.attention.w[qkv]", dtensor::ColwiseParallel().use_local_output(false)},
          {"layers.*.attention.wo", dtensor::RowwiseParallel().use_local_output(false)},
          {"layers.*.feed_forward.w1", dtensor::ColwiseParallel().use_local_output(false)},
          {"layers.*.feed_forward.w2", dtensor::RowwiseParallel().use_local_output(false)},
          {"output", dtensor::ColwiseParallel().use_local_output(false)},
      });
  dtensor::distribute_module(*model, tp); // the norms' parameters: Replicate
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1e-2));
  using Clock = std::chrono::steady_clock;
  std::vector<double> ms;
  Measured m;
  for (int i = 0; i < f.warmup + f.steps + 1; ++i) {
    const bool measured = i == f.warmup + f.steps; // counts and memory: one more step
    at::manual_seed(100 + i);
    auto tokens = at::randint(f.vocab, {f.batch, f.seq}, at::kLong);
    auto target = dtensor::distribute_tensor(at::randint(f.vocab, {f.batch * f.seq}, at::kLong), tp,
                                             {dtensor::Placement::replicate()});
    dtensor::barrier(tp.get_group());
    const int64_t before = memory.live();
    memory.reset_peak();
    std::optional<dtensor::CommDebugMode> mode;
    if (measured) {
      mode.emplace();
    }
    const auto t0 = Clock::now();
    opt.zero_grad();
    std::optional<dtensor::LossParallel> scope;
    if (loss_parallel) {
      scope.emplace();
    }
    at::Tensor logits = model->forward(tokens).view({-1, f.vocab});
    at::Tensor loss = torch::nn::functional::cross_entropy(logits, target);
    loss.backward();
    scope.reset();
    opt.step();
    if (i >= f.warmup && !measured) {
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    if (measured) {
      m.collectives = mode->total_count();
      m.all_gathers = mode->count(dtensor::CollectiveKind::AllGather);
      m.bytes_in = mode->total_bytes_out(); // what each rank receives
      m.peak = memory.peak() - before;
      m.loss = dtensor::DTensor(loss).full_tensor().item<double>();
    }
  }
  std::sort(ms.begin(), ms.end());
  m.ms = ms[ms.size() / 2];
  return m;
}

} // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  at::set_num_threads(1);
  auto& memory = dtensor::testing::CountingCPUAllocator::install();
  dtensor::init_process_group();
  auto tp = dtensor::init_device_mesh(c10::kCPU, {dtensor::get_world_size()}, {"tp"});
  const bool print = dtensor::get_rank() == 0;
  if (print) {
    std::printf("Transformer dim %lld, %lld layers, vocab %lld, batch %lld x seq %lld per step\n\n",
                static_cast<long long>(f.dim), static_cast<long long>(f.layers),
                static_cast<long long>(f.vocab), static_cast<long long>(f.batch),
                static_cast<long long>(f.seq));
    std::printf("| ranks | LossParallel | collectives / step | of them all-gathers | MB of "
                "collective outputs / step "
                "| peak MiB | step ms | loss |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: | "
                "---: |\n");
  }
  for (bool on : {false, true}) {
    const Measured m = run(f, tp, on, memory);
    if (print) {
      std::printf("| %lld | %s | %lld | %lld | %.2f | %.1f | %.0f | %.6f |\n",
                  static_cast<long long>(dtensor::get_world_size()), on ? "on" : "off",
                  static_cast<long long>(m.collectives), static_cast<long long>(m.all_gathers),
                  static_cast<double>(m.bytes_in) / 1e6, static_cast<double>(m.peak) / (1 << 20),
                  m.ms, m.loss);
      std::fflush(stdout);
    }
  }
  return 0;
}
