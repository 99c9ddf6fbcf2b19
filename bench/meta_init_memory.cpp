// Memory per rank of a model larger than one device (docs/meta_init.md): the Transformer built
// on the meta device, parallelized (FSDP, FSDP x TP, HSDP x TP), given memory by to_empty and
// initialized layout-independently, then trained (AdamW, clip 1.0). Every CPU allocation of
// the process is counted (test/support/cpu_memory.h: the allocator itself, not dtensor's
// word). Printed per layout, the largest figure over the ranks:
//   init: peak while materializing and initializing, against the bound own pieces + the
//         largest single piece; what stays (= own pieces, exactly);
//   step: peak of one training step above what lives before it, split into fully_shard's
//         buffers (fsdp_memory_stats, against its bound with overlap on, docs/fsdp.md
//         "Memory": root + 2 x largest block + the largest reduce-scatter input) and the
//         rest (activations, autograd, gradients before the reduce-scatter);
//   the whole model's bytes: what every rank held first before meta init.
// Run under torchrun on 8 ranks; rank 0 prints markdown rows.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <dtensor/all.h>

#include "support/cpu_memory.h"
#include "support/transformer_tp.h"

#include "flags.h"

namespace {

using dtensor::DeviceMesh;
using dtensor::FullyShardOptions;
using dtensor::models::Transformer;

constexpr int64_t kBatchPerRank = 4;

struct Layout {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<std::string> names;
};

dtensor::models::ModelArgs bench_args() {
  return dtensor::models::ModelArgs()
      .n_layers(4)
      .vocab_size(4096)
      .max_seq_len(64)
      .dim(256)
      .n_heads(8)
      .dropout_p(0.1)
      .weight_tying(false)
      .layout_independent_dropout(true);
}

int64_t max_over_ranks(int64_t v) {
  at::Tensor t = at::full({1}, static_cast<double>(v), at::kDouble);
  dtensor::all_reduce_(t, dtensor::ReduceOp::Max, dtensor::world_group());
  return static_cast<int64_t>(t.item<double>());
}

double mb(int64_t bytes) {
  return static_cast<double>(bytes) / 1e6;
}

int64_t local_bytes(const at::Tensor& p) {
  return static_cast<int64_t>(
      (dtensor::is_dtensor(p) ? dtensor::DTensor(p).to_local() : p).nbytes());
}

int64_t global_bytes(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) {
    n += p.numel() * p.element_size(); // DTensors report their full shape
  }
  return n;
}

// A unit's unsharded buffer: its parameters gathered over the shard dim (each padded to a
// multiple of its size, as fully_shard pads; under TP, the tp-local piece).
int64_t unsharded_bytes(const dtensor::FSDPModule& unit, int64_t shard_size) {
  int64_t n = 0;
  for (const auto& p : unit.managed_parameters()) {
    n += local_bytes(p) * shard_size;
  }
  return n;
}

void run(const Layout& l, dtensor::testing::CountingCPUAllocator& memory) {
  const DeviceMesh mesh = dtensor::init_device_mesh(c10::kCPU, l.shape, l.names);
  const bool tp = std::find(l.names.begin(), l.names.end(), "tp") != l.names.end();
  std::vector<std::string> dp_names(l.names.begin(), l.names.end() - (tp ? 1 : 0));
  const DeviceMesh dp = dp_names.size() == 1 ? mesh[dp_names[0]] : mesh[dp_names];

  Transformer model{nullptr};
  {
    dtensor::MetaDeviceGuard meta;
    model = Transformer(bench_args());
  }
  const int64_t whole = global_bytes(model->parameters());
  if (tp) {
    dtensor::testing::parallelize_transformer_tp(model, mesh["tp"]);
  }
  const int64_t shard_size = dp.size(dp.ndim() - 1); // HSDP: (dp_replicate, dp_shard)
  int64_t block_bytes = 0;
  for (auto& layer : *model->layers) {
    auto unit = dtensor::fully_shard(*layer, FullyShardOptions().mesh(dp));
    block_bytes = std::max(block_bytes, unsharded_bytes(unit, shard_size));
  }
  const int64_t root_bytes =
      unsharded_bytes(dtensor::fully_shard(*model, FullyShardOptions().mesh(dp)), shard_size);

  // Init: memory for this rank's pieces only, filled in place.
  memory.mark();
  dtensor::manual_seed(0, mesh);
  dtensor::to_empty(*model, c10::kCPU);
  dtensor::models::init_weights(*model);
  const int64_t init_peak = memory.window_peak();
  const int64_t init_live = memory.window_live();
  int64_t own = 0;
  int64_t largest = 0;
  for (const auto& p : model->parameters()) {
    own += local_bytes(p);
    largest = std::max(largest, local_bytes(p));
  }

  // Steps: 2 to warm up (AdamW's state appears in the first), the third measured.
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto [index, parts] = dtensor::testing::batch_slice(dp);
  const at::Tensor tokens =
      at::randint(bench_args().vocab_size(), {kBatchPerRank * parts, bench_args().max_seq_len()},
                  at::TensorOptions().dtype(at::kLong));
  const at::Tensor mine = tokens.narrow(0, index * kBatchPerRank, kBatchPerRank);
  int64_t step_peak = 0;
  int64_t fsdp_peak = 0;
  for (int step = 0; step < 3; ++step) {
    memory.mark();
    dtensor::reset_fsdp_peak_memory();
    opt.zero_grad(true);
    at::Tensor logits = dtensor::testing::whole(model->forward(mine));
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.flatten(0, 1), mine.roll(-1, 1).flatten());
    loss.backward();
    dtensor::clip_grad_norm_(model->parameters(), 1.0);
    opt.step();
    step_peak = memory.window_peak();
    fsdp_peak = dtensor::fsdp_memory_stats().peak_bytes;
  }
  // docs/fsdp.md "Memory": K (the root) + 2 G (the block in use and the prefetched one) + R
  // (one reduce-scatter input in flight, of the largest unit: the root's is the last).
  const int64_t fsdp_bound =
      max_over_ranks(root_bytes + 2 * block_bytes + std::max(root_bytes, block_bytes));

  const int64_t r_init_peak = max_over_ranks(init_peak);
  const int64_t r_own = max_over_ranks(own);
  const int64_t r_bound = max_over_ranks(own + largest);
  const int64_t r_live = max_over_ranks(init_live);
  const int64_t r_step = max_over_ranks(step_peak);
  const int64_t r_fsdp = max_over_ranks(fsdp_peak);
  if (dtensor::get_rank() == 0) {
    std::string where;
    for (size_t d = 0; d < l.shape.size(); ++d) {
      where += (d == 0 ? "" : ", ") + l.names[d] + "=" + std::to_string(l.shape[d]);
    }
    std::printf("| %s (%s) | %.2f | %.3f / %.3f (%.0f%%) | %.3f (own %.3f) | %.2f | %.2f / %.2f "
                "(%.0f%%) | %.2f |\n",
                l.name.c_str(), where.c_str(), mb(whole), mb(r_init_peak), mb(r_bound),
                100.0 * static_cast<double>(r_init_peak) / static_cast<double>(r_bound), mb(r_live),
                mb(r_own), mb(r_step), mb(r_fsdp), mb(fsdp_bound),
                100.0 * static_cast<double>(r_fsdp) / static_cast<double>(fsdp_bound),
                mb(r_step - r_fsdp));
  }
}

} // namespace

int main(int argc, char** argv) {
  // No flags: --help prints the usage line, anything else is refused.
  dtensor::cli::FlagTable("bench_meta_init_memory", "bench/meta_init_memory.cpp").parse(argc, argv);
  at::set_num_threads(1);
  auto& memory = dtensor::testing::CountingCPUAllocator::install();
  dtensor::init_process_group();
  const int64_t w = dtensor::get_world_size();
  std::vector<Layout> layouts{{"FSDP", {w}, {"dp"}}};
  if (w % 2 == 0 && w >= 4) {
    layouts.push_back({"FSDP x TP", {w / 2, 2}, {"dp", "tp"}});
  }
  if (w % 4 == 0 && w >= 8) {
    layouts.push_back({"HSDP x TP", {2, w / 4, 2}, {"dp_replicate", "dp_shard", "tp"}});
  }
  if (dtensor::get_rank() == 0) {
    std::printf("| layout on %lld ranks | whole model MB | init peak / bound MB | after init MB | "
                "step peak MB | fully_shard peak / bound MB | rest of the step MB |\n"
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
                static_cast<long long>(w));
  }
  for (const auto& l : layouts) {
    run(l, memory);
  }
  dtensor::destroy_process_group();
  return 0;
}
