// One training step of a stack of mixture-of-experts blocks with expert parallelism, timed:
// the dtensor side of bench/moe.py, which runs the same model written with PyTorch 2.15's
// public API (bench/moe.py --worker) alternately with it. Run under torchrun.
//   model: --layers blocks x + MoE(RMSNorm(x)) (models/moe/moe.h: softmax top-k router,
//          route_norm, --experts routed SwiGLU experts of --hidden, one shared expert, no
//          load-balancing bias), width --dim, fp32;
//   parallelism: the dense ranks are the whole world ("dp"); the experts over the sparse mesh
//          (efsdp, ep) with --ep (ExpertParallel, the count exchange started by the router
//          unless --no-early-exchange; --capacity-factor F: capacity dispatch, no counts
//          exchange; --overlap: its buffers in two overlapped chunks; --float8-dispatch: the
//          dispatched rows as float8), fully_shard of the
//          experts over efsdp and of each
//          block and the root over dp;
//   step: --tokens rows per rank, loss sum(out * g) / rows, backward, AdamW.
// Rank 0 prints "RESULT <json>": the median step time (ms), each step's time, the mean time a
// layer's experts call waited for its split sizes (ExpertParallel's counts, us per layer per
// step), all-to-alls per step, rank 0's forward all-to-all kB per layer (counts, dispatch,
// combine), and, under LD_PRELOAD of bench/live_bytes.cpp, the largest
// rank's peak of live tensor bytes over the timed steps (MB).

#include <algorithm>
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
#include <models/moe/moe.h>
#include <models/moe/parallelize.h>

namespace {

using Clock = std::chrono::steady_clock;
using bench::json_list;
using bench::live_bytes_fn;
using bench::median;
using dtensor::models::MoE;
using dtensor::models::MoEArgs;
using dtensor::models::RMSNorm;

struct Flags {
  int64_t dim = 128, hidden = 128, experts = 8, top_k = 2, layers = 2, tokens = 256, ep = 2;
  int64_t steps = 10, warmup = 3;
  bool early_exchange = true;
  double capacity_factor = 0; // > 0: capacity dispatch with this factor (docs/moe.md)
  bool float8_dispatch = false;
  bool overlap = false; // capacity dispatch in two overlapped chunks
};

Flags parse(int argc, char** argv) {
  Flags f;
  bool late_exchange = false;
  dtensor::cli::FlagTable("bench_moe", "bench/moe.cpp")
      .value("--dim", "model width (128)", f.dim)
      .value("--hidden", "each expert's hidden width (128)", f.hidden)
      .value("--experts", "routed experts (8)", f.experts)
      .value("--top-k", "experts per token (2)", f.top_k)
      .value("--layers", "blocks (2)", f.layers)
      .value("--tokens", "rows per rank (256)", f.tokens)
      .value("--ep", "expert-parallel degree (2)", f.ep)
      .value("--steps", "timed steps (10)", f.steps)
      .value("--warmup", "untimed steps before them (3)", f.warmup)
      .toggle("--no-early-exchange", "the router does not start the counts exchange", late_exchange)
      .value("--capacity-factor", "> 0: capacity dispatch with this factor (0)", f.capacity_factor)
      .toggle("--overlap", "with --capacity-factor: its buffers in two overlapped chunks",
              f.overlap)
      .toggle("--float8-dispatch", "the dispatched rows as float8", f.float8_dispatch)
      .parse(argc, argv);
  f.early_exchange = !late_exchange;
  return f;
}

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const MoEArgs& a)
      : norm(register_module("norm", RMSNorm(a.dim(), 1e-5))), moe(register_module("moe", MoE(a))) {
  }
  at::Tensor forward(const at::Tensor& x) { return x + dtensor::call(moe, dtensor::call(norm, x)); }
  RMSNorm norm;
  MoE moe;
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl(const MoEArgs& a, int64_t layers) {
    for (int64_t i = 0; i < layers; ++i) {
      blocks.push_back(register_module(std::to_string(i), Block(a)));
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
  const int world = dtensor::get_world_size();
  const auto args = MoEArgs()
                        .dim(f.dim)
                        .hidden_dim(f.hidden)
                        .num_experts(f.experts)
                        .top_k(f.top_k)
                        .num_shared_experts(1)
                        .route_norm(true)
                        .load_balance_coeff(std::nullopt);
  torch::manual_seed(0);
  Stack model(args, f.layers);
  for (auto& b : model->blocks) {
    b->moe->init_weights(0.02);
  }
  const auto dense = dtensor::init_device_mesh(c10::kCPU, {world}, {"dp"});
  const auto sparse = dtensor::models::moe_sparse_mesh(dense, f.ep);
  for (auto& b : model->blocks) {
    auto options = dtensor::ExpertParallelOptions().float8_dispatch(f.float8_dispatch);
    if (f.capacity_factor > 0) {
      options.dispatch(dtensor::EpDispatch::Capacity)
          .capacity_factor(f.capacity_factor)
          .overlap(f.overlap);
    }
    dtensor::ExpertParallel style(options);
    style.apply(*b->moe->experts, sparse["ep"]);
    if (f.early_exchange) {
      style.apply_router(*b->moe->router, sparse["ep"]);
    }
    dtensor::models::fully_shard_experts(b->moe, sparse, {}, world);
    dtensor::fully_shard(*b, dtensor::FullyShardOptions().mesh(dense));
  }
  dtensor::fully_shard(*model, dtensor::FullyShardOptions().mesh(dense));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  at::manual_seed(1 + dtensor::get_rank());
  const at::Tensor x = at::randn({f.tokens, f.dim});
  const at::Tensor g = at::randn({f.tokens, f.dim});
  int64_t all_to_alls = 0, dispatch_bytes = 0;
  auto step = [&] {
    opt.zero_grad();
    dtensor::CommDebugMode comm;
    at::Tensor out = dtensor::call(model, x);
    dispatch_bytes = comm.bytes_in(dtensor::CollectiveKind::AllToAll); // forward: counts too
    ((out * g).sum() / static_cast<double>(f.tokens)).backward();
    opt.step();
    all_to_alls = comm.count(dtensor::CollectiveKind::AllToAll);
  };
  for (int i = 0; i < f.warmup; ++i) {
    step();
  }
  if (auto* reset = live_bytes_fn<void()>("live_bytes_reset_peak")) {
    reset();
  }
  dtensor::reset_ep_stats();
  std::vector<double> ms;
  for (int i = 0; i < f.steps; ++i) {
    dtensor::barrier(dtensor::world_group());
    const auto t0 = Clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  const double wait_us =
      dtensor::ep_stats().wait_seconds * 1e6 / static_cast<double>(f.steps * f.layers);
  auto* live_peak = live_bytes_fn<int64_t()>("live_bytes_peak");
  at::Tensor figures = at::tensor(
      {live_peak != nullptr ? static_cast<double>(live_peak()) / 1e6 : -1.0, wait_us}, at::kDouble);
  dtensor::all_reduce_(figures, dtensor::ReduceOp::Max, dtensor::world_group());
  if (dtensor::get_rank() == 0) {
    std::printf("RESULT {\"ms\": %f, \"step_ms\": %s, \"wait_us\": %f, \"all_to_alls\": %lld, "
                "\"forward_a2a_kb_per_layer\": %f, \"live_peak_mb\": %f}\n",
                median(ms), json_list(ms).c_str(), figures[1].item<double>(),
                static_cast<long long>(all_to_alls),
                static_cast<double>(dispatch_bytes) / 1e3 / static_cast<double>(f.layers),
                figures[0].item<double>());
    std::fflush(stdout);
  }
  return 0;
}
