// A training step of a stack of feed-forward blocks under fully_shard with float8 linears:
// the dtensor side of bench/float8.py, which runs the same model with torchao's Float8Linear
// and PyTorch's FSDP2 alternately with it. Run under torchrun.
//   model: --layers blocks x + FFN(RMSNorm(x)) (models/llama3/layers.h: SwiGLU w1, w3 of
//          --hidden, w2 back to --dim, no biases), fp32 parameters;
//   parallelism: fully_shard of each block and the root over the world, bf16 parameters in
//          forward and backward, fp32 gradient reduction;
//   --float8 none|tensorwise|rowwise|rowwise_with_gw_hp: every Linear converted
//          (convert_to_float8_training); --float8-all-gather: fully_shard gathers them in
//          float8, their scales precomputed after each optimizer step;
//   --overlap on|off: fully_shard's communication overlap (off: each collective completes
//          where it is issued, the schedule PyTorch FSDP2 has on CPU, where there are no streams);
//   step: --tokens rows per rank, loss sum(out * g) / rows, backward, AdamW.
// Rank 0 prints "RESULT <json>": the median step time (ms), the all-gathered bytes and the
// all-reduces of the last step (this rank's, the precompute included), and, under LD_PRELOAD
// of bench/live_bytes.cpp, the largest rank's peak of live tensor bytes over the timed steps
// (MB).
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include "bench_util.h"
#include "flags.h"
#include <dtensor/all.h>
#include <models/llama3/layers.h>

namespace {

using Clock = std::chrono::steady_clock;
using bench::json_list;
using bench::live_bytes_fn;
using bench::median;
using dtensor::models::Llama3FeedForward;
using dtensor::models::RMSNorm;

struct Flags {
  int64_t dim = 256, hidden = 512, layers = 2, tokens = 256;
  int64_t steps = 8, warmup = 3;
  std::string float8 = "none";
  bool all_gather = false;
  std::string overlap = "on";
};

Flags parse(int argc, char** argv) {
  Flags f;
  dtensor::cli::FlagTable("bench_float8", "bench/float8.cpp")
      .value("--float8", "the float8 recipe of every Linear, or none (none)", f.float8,
             {"none", "tensorwise", "rowwise", "rowwise_with_gw_hp"})
      .toggle("--float8-all-gather", "with --float8: fully_shard all-gathers the weights in float8",
              f.all_gather)
      .value("--dim", "model width (256)", f.dim)
      .value("--hidden", "the feed-forward's hidden width (512)", f.hidden)
      .value("--layers", "blocks (2)", f.layers)
      .value("--tokens", "rows per rank (256)", f.tokens)
      .value("--steps", "timed steps (8)", f.steps)
      .value("--warmup", "untimed steps before them (3)", f.warmup)
      .value("--overlap",
             "fully_shard's communication overlap (on; off: PyTorch FSDP2's CPU "
             "schedule)",
             f.overlap, {"on", "off"})
      .parse(argc, argv);
  return f;
}

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t hidden)
      : norm(register_module("norm", RMSNorm(dim, 1e-5))),
        ffn(register_module("ffn", Llama3FeedForward(dim, hidden))) {}
  at::Tensor forward(const at::Tensor& x) { return x + dtensor::call(ffn, dtensor::call(norm, x)); }
  RMSNorm norm;
  Llama3FeedForward ffn;
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t dim, int64_t hidden, int64_t layers) {
    for (int64_t i = 0; i < layers; ++i) {
      blocks.push_back(register_module(std::to_string(i), Block(dim, hidden)));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) {
      x = dtensor::call(b, x);
    }
    return x;
  }
  std::vector<Block> blocks;
};
TORCH_MODULE(Stack);

} // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  at::set_num_threads(1);
  dtensor::init_process_group();
  torch::manual_seed(0);
  Stack model(f.dim, f.hidden, f.layers);
  for (auto& b : model->blocks) {
    b->ffn->init_weights(0.02);
  }
  if (f.float8 != "none") {
    dtensor::convert_to_float8_training(*model,
                                        dtensor::Float8LinearOptions()
                                            .recipe(dtensor::float8_recipe_from_name(f.float8))
                                            .enable_fsdp_float8_all_gather(f.all_gather));
  }
  const auto mesh = dtensor::init_device_mesh(c10::kCPU, {dtensor::get_world_size()}, {"dp"});
  const auto options = dtensor::FullyShardOptions().mesh(mesh).mp_policy(
      dtensor::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  for (auto& b : model->blocks) {
    dtensor::fully_shard(*b, options);
  }
  dtensor::fully_shard(*model, options).set_communication_overlap(f.overlap == "on");
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  at::manual_seed(1 + dtensor::get_rank());
  const at::Tensor x = at::randn({f.tokens, f.dim});
  const at::Tensor g = at::randn({f.tokens, f.dim});
  int64_t gathered = 0;
  int64_t all_reduces = 0;
  auto step = [&] {
    opt.zero_grad();
    dtensor::CommDebugMode comm;
    at::Tensor out = dtensor::call(model, x);
    ((out.to(at::kFloat) * g).sum() / static_cast<double>(f.tokens)).backward();
    opt.step();
    if (f.all_gather) {
      dtensor::precompute_float8_dynamic_scale_for_fsdp(*model);
    }
    gathered = comm.bytes_in(dtensor::CollectiveKind::AllGather);
    all_reduces = comm.count(dtensor::CollectiveKind::AllReduce);
  };
  for (int i = 0; i < f.warmup; ++i) {
    step();
  }
  if (auto* reset = live_bytes_fn<void()>("live_bytes_reset_peak")) {
    reset();
  }
  std::vector<double> ms;
  for (int i = 0; i < f.steps; ++i) {
    dtensor::barrier(dtensor::world_group());
    const auto t0 = Clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  auto* live_peak = live_bytes_fn<int64_t()>("live_bytes_peak");
  at::Tensor peak = at::tensor(
      {live_peak != nullptr ? static_cast<double>(live_peak()) / 1e6 : -1.0}, at::kDouble);
  dtensor::all_reduce_(peak, dtensor::ReduceOp::Max, dtensor::world_group());
  if (dtensor::get_rank() == 0) {
    std::printf("RESULT {\"ms\": %f, \"step_ms\": %s, \"all_gather_bytes\": %lld, "
                "\"all_reduces\": %lld, \"live_peak_mb\": %f}\n",
                median(ms), json_list(ms).c_str(), static_cast<long long>(gathered),
                static_cast<long long>(all_reduces), peak[0].item<double>());
    std::fflush(stdout);
  }
  return 0;
}
