// clip_grad_norm_ cost against the number of gradients (10 to 10,000 Shard(0) DTensor
// gradients of 64 elements, half of them on a second mesh dimension's slice): time per call
// and the all-reduce count, which must stay at one per mesh dimension. Rank 0 prints rows.
#include <chrono>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dtensor/all.h>

#include "flags.h"

int main(int argc, char** argv) {
  // No flags: --help prints the usage line, anything else is refused.
  dtensor::cli::FlagTable("bench_clip_grad_norm", "bench/clip_grad_norm.cpp").parse(argc, argv);
  at::set_num_threads(1);
  dtensor::init_process_group();
  const int world = dtensor::get_world_size();
  const int64_t tp = world >= 2 ? 2 : 1;
  auto mesh = dtensor::init_device_mesh(c10::kCPU, {world / tp, tp}, {"dp", "tp"});
  if (dtensor::get_rank() == 0) {
    std::printf(
        "| ranks | gradients | meshes | time per clip_grad_norm_ | per gradient | all-reduces |\n");
    std::printf("| ---: | ---: | --- | ---: | ---: | ---: |\n");
  }
  for (int64_t n : {10, 100, 1000, 10000}) {
    for (bool mixed : {false, true}) {
      std::vector<at::Tensor> params;
      for (int64_t i = 0; i < n; ++i) {
        const bool on_dp = mixed && i % 2 == 1;
        at::Tensor p =
            on_dp ? dtensor::distribute_tensor(at::randn({64}), mesh["dp"], {dtensor::Shard(0)},
                                               mesh["dp"].ranks().front())
                  : dtensor::distribute_tensor(at::randn({64}), mesh,
                                               {dtensor::Shard(0), dtensor::Replicate()});
        p.mutable_grad() = p.clone();
        params.push_back(p);
      }
      double best = 1e30;
      int64_t reduces = 0;
      for (int rep = 0; rep < 3; ++rep) {
        dtensor::barrier(dtensor::world_group());
        dtensor::CommDebugMode mode;
        auto t0 = std::chrono::steady_clock::now();
        at::Tensor total = dtensor::clip_grad_norm_(params, 1e9, 2.0);
        (void)total;
        best = std::min(
            best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                      .count());
        reduces = mode.count(dtensor::CollectiveKind::AllReduce);
      }
      if (dtensor::get_rank() == 0) {
        std::printf("| %d | %lld | %s | %.2f ms | %.2f us | %lld |\n", world,
                    static_cast<long long>(n), mixed ? "(dp, tp) and (dp)" : "(dp, tp)", best,
                    1000.0 * best / static_cast<double>(n), static_cast<long long>(reduces));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
