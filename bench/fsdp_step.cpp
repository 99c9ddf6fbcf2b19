// fully_shard on common_dtensor's Transformer (each block and the root a unit): step time,
// collective bytes against the analytical minimum, and fully_shard's own peak memory
// against root + largest block. Run under torchrun; rank 0 prints markdown rows.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <dtensor/all.h>

#include <models/fsdp_models.h>

#include "flags.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Size {
  int64_t dim, layers, heads, vocab, seq, batch;
};

int64_t bytes_of(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) {
    n += p.numel() * p.element_size(); // global sizes: DTensors report their full shape
  }
  return n;
}

void run(const Size& sz, int steps) {
  const int world = dtensor::get_world_size();
  auto mesh = dtensor::init_device_mesh(c10::kCPU, {world}, {"dp"});
  auto args = dtensor::models::ModelArgs()
                  .dim(sz.dim)
                  .n_layers(sz.layers)
                  .n_heads(sz.heads)
                  .vocab_size(sz.vocab)
                  .max_seq_len(sz.seq)
                  .dropout_p(0.0);
  torch::manual_seed(0);
  dtensor::models::Transformer model(args);
  std::vector<dtensor::FSDPModule> blocks;
  for (auto& layer : *model->layers) {
    blocks.push_back(dtensor::fully_shard(*layer, dtensor::FullyShardOptions().mesh(mesh)));
  }
  auto root = dtensor::fully_shard(*model, dtensor::FullyShardOptions().mesh(mesh));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));

  const int64_t root_bytes = bytes_of(root.managed_parameters());
  int64_t block_bytes = 0; // the largest block
  int64_t blocks_total = 0;
  for (auto& b : blocks) {
    block_bytes = std::max(block_bytes, bytes_of(b.managed_parameters()));
    blocks_total += bytes_of(b.managed_parameters());
  }
  const int64_t all_bytes = root_bytes + blocks_total;

  auto step = [&](int i) {
    at::manual_seed(100 + i + 7 * dtensor::get_rank());
    auto tokens = at::randint(sz.vocab, {sz.batch, sz.seq}, at::kLong);
    auto targets = at::randint(sz.vocab, {sz.batch, sz.seq}, at::kLong);
    opt.zero_grad();
    auto logits = model->forward(tokens);
    torch::nn::functional::cross_entropy(logits.view({-1, sz.vocab}), targets.view(-1)).backward();
    opt.step();
  };
  step(0);
  step(1); // warm-up
  // Bytes and memory of one step.
  dtensor::reset_fsdp_peak_memory();
  int64_t ag_wire = 0;
  int64_t rs_wire = 0;
  {
    dtensor::CommDebugMode mode;
    step(2);
    for (const auto& r : mode.records()) {
      // Ring algorithms: each rank receives (N-1)/N of the gathered or reduced buffer.
      if (r.kind == dtensor::CollectiveKind::AllGather) {
        ag_wire += r.bytes_out * (world - 1) / world;
      } else if (r.kind == dtensor::CollectiveKind::ReduceScatter) {
        rs_wire += r.bytes_in * (world - 1) / world;
      }
    }
  }
  const int64_t peak = dtensor::fsdp_memory_stats().peak_bytes;
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    dtensor::barrier(dtensor::world_group());
    auto t0 = Clock::now();
    step(3 + i);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  // Minimum: forward gathers every unit, backward every block (the root stays unsharded),
  // each gradient byte is reduce-scattered once; (N-1)/N of it crosses the wire per rank.
  const int64_t ag_min = (all_bytes + blocks_total) * (world - 1) / world;
  const int64_t rs_min = all_bytes * (world - 1) / world;
  // fully_shard's own memory (docs/fsdp.md "Memory", overlap on): the root stays
  // unsharded; the block in use and the prefetched one, and one reduce-scatter input in
  // flight, each about a block's size (padding aside).
  const int64_t mem_bound = root_bytes + 3 * block_bytes;
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  if (dtensor::get_rank() == 0) {
    std::printf(
        "| %d | dim %lld, %lld layers | %.2f MB | %.1f ms | %lld / %lld (%.2f%%) | %lld / %lld "
        "(%.2f%%) | "
        "%.2f / %.2f MB (%.0f%%) | %.0f MB |\n",
        world, static_cast<long long>(sz.dim), static_cast<long long>(sz.layers), all_bytes / 1e6,
        ms[ms.size() / 2], static_cast<long long>(ag_wire), static_cast<long long>(ag_min),
        ag_min > 0 ? 100.0 * (ag_wire - ag_min) / ag_min : 0.0, static_cast<long long>(rs_wire),
        static_cast<long long>(rs_min), rs_min > 0 ? 100.0 * (rs_wire - rs_min) / rs_min : 0.0,
        peak / 1e6, mem_bound / 1e6, 100.0 * peak / mem_bound, usage.ru_maxrss / 1024.0);
    std::fflush(stdout);
  }
}

} // namespace

int main(int argc, char** argv) {
  // No flags: --help prints the usage line, anything else is refused.
  dtensor::cli::FlagTable("bench_fsdp_step", "bench/fsdp_step.cpp").parse(argc, argv);
  at::set_num_threads(1);
  dtensor::init_process_group();
  if (dtensor::get_rank() == 0) {
    std::printf("| ranks | Transformer | params | step (median) | all-gather bytes/rank: measured "
                "/ minimum (excess) "
                "| reduce-scatter bytes/rank: measured / minimum (excess) | fully_shard peak / "
                "bound | peak RSS |\n");
    std::printf("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  }
  const std::vector<Size> sizes = {
      {64, 2, 4, 512, 64, 8}, {128, 4, 8, 1024, 64, 8}, {256, 4, 8, 2048, 64, 8}};
  for (const auto& s : sizes) {
    run(s, 10);
  }
  return 0;
}
