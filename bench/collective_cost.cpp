// The cluster table's CPU row (dtensor/collective_cost.h) against Gloo on this machine: dtensor's
// all-reduce, all-gather, reduce-scatter and all-to-all over every rank at 4 KiB to 16 MiB (NCCL's
// size: the whole buffer), each the median of --reps calls between barriers (after 3 warm-up
// calls), beside collective_cost's prediction on the "cpu" row. Rank 0 prints a Markdown table
// with the ratio measured / predicted. Run on 2 ranks:
//   torchrun --standalone --nproc-per-node 2 --no-python build/bench/bench_collective_cost
#include <chrono>
#include <cstdio>
#include <functional>
#include <numeric>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dtensor/all.h>

#include "bench_util.h"
#include "flags.h"

using dtensor::CollectiveKind;

namespace {

double median_ms(int64_t reps, const std::function<void()>& body) {
  for (int i = 0; i < 3; ++i) {
    body();
  }
  std::vector<double> ms;
  for (int64_t r = 0; r < reps; ++r) {
    dtensor::barrier(dtensor::world_group());
    const auto start = std::chrono::steady_clock::now();
    body();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  return bench::median(ms);
}

} // namespace

int main(int argc, char** argv) {
  int64_t reps = 20;
  dtensor::cli::FlagTable("bench_collective_cost", "bench/collective_cost.cpp")
      .value("--reps", "timed calls per collective and size (20)", reps)
      .parse(argc, argv);
  at::set_num_threads(1);
  dtensor::init_process_group();
  const auto& group = dtensor::world_group();
  const int world = dtensor::get_world_size();
  std::vector<int> ranks(static_cast<size_t>(world));
  std::iota(ranks.begin(), ranks.end(), 0);
  const auto cpu = dtensor::cluster_spec("cpu");
  if (dtensor::get_rank() == 0) {
    std::printf("%d ranks, Gloo, one thread a rank; the \"cpu\" row: %.0f us a step, %.2f GB/s\n\n"
                "| collective | bytes | measured ms | predicted ms | measured / predicted |\n"
                "| --- | ---: | ---: | ---: | ---: |\n",
                world, cpu.step_latency_us(), cpu.nvlink_gbps());
  }
  for (int64_t bytes : {int64_t{4} << 10, int64_t{64} << 10, int64_t{1} << 20, int64_t{16} << 20}) {
    const int64_t n = bytes / 4 / world * world; // floats, a multiple of the world
    at::Tensor full = at::randn({n});
    at::Tensor piece = at::randn({n / world});
    const std::vector<std::pair<CollectiveKind, std::function<void()>>> cases = {
        {CollectiveKind::AllReduce,
         [&] { dtensor::all_reduce_(full, dtensor::ReduceOp::Sum, group); }},
        {CollectiveKind::AllGather, [&] { dtensor::all_gather_tensor(piece, 0, group); }},
        {CollectiveKind::ReduceScatter,
         [&] { dtensor::reduce_scatter_tensor(full, dtensor::ReduceOp::Sum, 0, group); }},
        {CollectiveKind::AllToAll, [&] { dtensor::all_to_all_single(full, {}, {}, group); }},
    };
    for (const auto& [kind, body] : cases) {
      const double measured = median_ms(reps, body);
      const double predicted = dtensor::collective_cost(kind, n * 4, ranks, cpu).seconds * 1e3;
      if (dtensor::get_rank() == 0) {
        std::printf("| %s | %lld | %.3f | %.3f | %.2f |\n", dtensor::to_string(kind).c_str(),
                    static_cast<long long>(n * 4), measured, predicted, measured / predicted);
      }
    }
  }
  return 0;
}
