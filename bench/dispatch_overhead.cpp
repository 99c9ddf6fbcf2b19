// Dispatch overhead of DTensor ops: `add` of two small Shard(0) DTensors minus the same
// plain `add` on their local tensors, per op, on a sharding-cache hit; and the cost of a
// miss (a new shape each time: rule, meta shape inference, cache insert).
// Run alone (world of one) or under torchrun; rank 0 prints a markdown table.
#include <chrono>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dtensor/all.h>

#include "flags.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double best_us_per_op(int reps, int iters, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      f(i);
    }
    double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
    best = std::min(best, us);
  }
  return best;
}

} // namespace

int main(int argc, char** argv) {
  // No flags: --help prints the usage line, anything else is refused.
  dtensor::cli::FlagTable("bench_dispatch_overhead", "bench/dispatch_overhead.cpp")
      .parse(argc, argv);
  at::set_num_threads(1);
  dtensor::init_process_group();
  auto mesh = dtensor::init_device_mesh(c10::kCPU, {dtensor::get_world_size()}, {"x"});
  const dtensor::Placements s0{dtensor::Shard(0)};
  at::Tensor x = at::randn({8 * dtensor::get_world_size(), 8});
  dtensor::DTensor a = dtensor::distribute_tensor(x, mesh, s0);
  dtensor::DTensor b = dtensor::distribute_tensor(x, mesh, s0);
  at::Tensor la = a.to_local();
  at::Tensor lb = b.to_local();

  const int iters = 20000;
  double plain = best_us_per_op(5, iters, [&](int) { (void)(la + lb); });
  double hit = best_us_per_op(5, iters, [&](int) { (void)(a + b); });

  // Misses: every iteration a shape never seen before.
  const int misses = 300;
  std::vector<dtensor::DTensor> xs;
  std::vector<dtensor::DTensor> ys;
  for (int i = 0; i < misses; ++i) {
    at::Tensor t = at::randn({8 * dtensor::get_world_size(), 1000 + i});
    xs.push_back(dtensor::distribute_tensor(t, mesh, s0));
    ys.push_back(dtensor::distribute_tensor(t, mesh, s0));
  }
  double miss = best_us_per_op(
      1, misses, [&](int i) { (void)(xs[static_cast<size_t>(i)] + ys[static_cast<size_t>(i)]); });

  if (dtensor::get_rank() == 0) {
    std::printf("| measure (world %d, add of two Float[%d, 8] Shard(0) DTensors) | us per op |\n",
                dtensor::get_world_size(), 8 * dtensor::get_world_size());
    std::printf("| --- | ---: |\n");
    std::printf("| plain add of the local tensors | %.2f |\n", plain);
    std::printf("| DTensor add, cache hit | %.2f |\n", hit);
    std::printf("| **overhead on a hit** (hit - plain) | **%.2f** |\n", hit - plain);
    std::printf("| DTensor add, cache miss (new shape each time) | %.1f |\n", miss);
  }
  dtensor::destroy_process_group();
  return 0;
}
