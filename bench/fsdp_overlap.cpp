// One training step of fully_shard + AdamW + clip_grad_norm_, timed; the dtensor side of
// bench/fsdp_overlap.py, which runs PyTorch FSDP2 on the same model alternately with it.
// Run under torchrun. Models:
//   mlp: 4 blocks Linear(d, 4d)-GELU-Linear(4d, d), fully_shard per block and the root,
//        input [8, 32, d] per rank, loss mean(out^2);
//   tp:  the main job's Transformer (examples/train.cpp: wq/wk/wv/w1 colwise, wo/w2
//        rowwise) on a (dp, tp = 2) mesh, fully_shard per block and the root, random tokens.
// Flags: --model mlp|tp, --dim D, --steps N, --warmup N, --overlap 0|1.
// Rank 0 prints one line: "RESULT <json>" with the per-step times in ms.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <dtensor/all.h>

#include <models/fsdp_models.h>

#include "flags.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string model = "mlp";
  int64_t dim = 64;
  int64_t steps = 10;
  int64_t warmup = 3;
  bool overlap = true;
};

Flags parse(int argc, char** argv) {
  Flags f;
  std::string overlap = "1";
  dtensor::cli::FlagTable("bench_fsdp_overlap", "bench/fsdp_overlap.cpp")
      .value("--model", "the model: the MLP blocks or the tensor-parallel Transformer (mlp)",
             f.model, {"mlp", "tp"})
      .value("--dim", "model width (64)", f.dim)
      .value("--steps", "timed steps (10)", f.steps)
      .value("--warmup", "untimed steps before them (3)", f.warmup)
      .value("--overlap", "FSDP's communication overlap, 0 or 1 (1)", overlap, {"0", "1"})
      .parse(argc, argv);
  f.overlap = overlap == "1";
  return f;
}

// A model, its root unit, and one step's forward + loss.
struct Job {
  std::shared_ptr<torch::nn::Module> module;
  dtensor::FSDPModule root;
  std::function<at::Tensor(int)> loss;
};

// Linear(d, 4d)-GELU-Linear(4d, d).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : up(register_module("up", torch::nn::Linear(d, 4 * d))),
        down(register_module("down", torch::nn::Linear(4 * d, d))) {}
  at::Tensor forward(const at::Tensor& x) { return down->forward(gelu->forward(up->forward(x))); }
  torch::nn::Linear up, down;
  torch::nn::GELU gelu;
};
TORCH_MODULE(Block);

Job mlp_job(const Flags& f) {
  const int world = dtensor::get_world_size();
  auto mesh = dtensor::init_device_mesh(c10::kCPU, {world}, {"dp"});
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int b = 0; b < 4; ++b) {
    model->push_back(Block(f.dim));
  }
  for (auto& block : model->children()) {
    dtensor::fully_shard(*block, dtensor::FullyShardOptions().mesh(mesh));
  }
  Job job;
  job.root = dtensor::fully_shard(*model, dtensor::FullyShardOptions().mesh(mesh));
  job.module = model.ptr();
  const int64_t dim = f.dim;
  job.loss = [model, dim](int step) mutable {
    at::manual_seed(100 + step + 7 * dtensor::get_rank());
    return model->forward(at::randn({8, 32, dim})).square().mean();
  };
  return job;
}

Job tp_job(const Flags& f) {
  const int world = dtensor::get_world_size();
  auto mesh = dtensor::init_device_mesh(c10::kCPU, {world / 2, 2}, {"dp", "tp"});
  const int64_t vocab = 64, seq = 32;
  auto args = dtensor::models::ModelArgs()
                  .vocab_size(vocab)
                  .max_seq_len(seq)
                  .dim(f.dim)
                  .n_layers(2)
                  .n_heads(4)
                  .dropout_p(0.0);
  torch::manual_seed(0);
  dtensor::models::Transformer model(args);
  auto col = std::make_shared<dtensor::ColwiseParallel>();
  auto row = std::make_shared<dtensor::RowwiseParallel>();
  dtensor::parallelize_module(*model, mesh["tp"],
                              dtensor::ParallelizePlan{{"layers.*.attention.w[qkv]", col},
                                                       {"layers.*.attention.wo", row},
                                                       {"layers.*.feed_forward.w1", col},
                                                       {"layers.*.feed_forward.w2", row}});
  for (auto& layer : *model->layers) {
    dtensor::fully_shard(*layer, dtensor::FullyShardOptions().mesh(mesh["dp"]));
  }
  Job job;
  job.root = dtensor::fully_shard(*model, dtensor::FullyShardOptions().mesh(mesh["dp"]));
  job.module = model.ptr();
  const int64_t dp_rank = mesh.get_local_rank(0);
  job.loss = [model, dp_rank, vocab](int step) mutable {
    at::manual_seed(100 + step + 7 * dp_rank);
    auto tokens = at::randint(vocab, {8, seq}, at::kLong);
    auto targets = at::randint(vocab, {8, seq}, at::kLong);
    return torch::nn::functional::cross_entropy(model->forward(tokens).view({-1, vocab}),
                                                targets.view(-1));
  };
  return job;
}

} // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  at::set_num_threads(1);
  dtensor::init_process_group();
  Job job = f.model == "tp" ? tp_job(f) : mlp_job(f);
  job.root.set_communication_overlap(f.overlap);
  torch::optim::AdamW opt(job.module->parameters(), torch::optim::AdamWOptions(1e-3));
  auto step = [&](int i) {
    opt.zero_grad();
    job.loss(i).backward();
    job.root.clip_grad_norm_(1.0);
    opt.step();
  };
  for (int i = 0; i < f.warmup; ++i) {
    step(i);
  }
  std::vector<double> ms;
  for (int i = 0; i < f.steps; ++i) {
    dtensor::barrier(dtensor::world_group());
    const auto t0 = Clock::now();
    step(f.warmup + i);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  if (dtensor::get_rank() == 0) {
    std::string list;
    for (double m : ms) {
      list += (list.empty() ? "" : ", ") + std::to_string(m);
    }
    const auto peak = dtensor::fsdp_memory_stats().peak_bytes;
    std::printf("RESULT {\"step_ms\": [%s], \"fsdp_peak_bytes\": %lld}\n", list.c_str(),
                static_cast<long long>(peak));
    std::fflush(stdout);
  }
  return 0;
}
