// One reduce-scatter and one all-gather on the CPU mesh over Gloo: dtensor's side of
// bench/reduce_scatter.py, which times PyTorch's dist.reduce_scatter_tensor and
// dist.all_gather_into_tensor on the same ranks alternately with it. dtensor sends sum and
// avg over 2+ ranks as an all-to-all plus a local sum ([Note: Gloo's reduce-scatter as an
// all-to-all] in lib/mesh/collectives.cpp), where ProcessGroupGloo all-reduces a clone of
// the input; on two ranks both collectives exchange just the peer's rows ([Note: two Gloo
// ranks by split sizes]). Run under torchrun. Rank 0 prints "RESULT <json>": for each
// collective ("rs", "ag") and unsharded size (floats; 16 KiB shows the fixed cost of the
// agreement on sizes, [Note: agreeing on sizes]), the median milliseconds of 20
// synchronous calls (reduce-scatter: sum) after 3 warm-up ones, each after a barrier; and
// "fl": DTensor::from_local of a 2x2 tensor without a shape, timed the same way.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dtensor/all.h>

#include "flags.h"

int main(int argc, char** argv) {
  // No flags: --help prints the usage line, anything else is refused.
  dtensor::cli::FlagTable("bench_reduce_scatter", "bench/reduce_scatter.cpp").parse(argc, argv);
  at::set_num_threads(1);
  dtensor::init_process_group();
  const int64_t world = dtensor::get_world_size();
  auto group = dtensor::init_device_mesh(c10::kCPU, {world}, {"x"}).get_group();
  std::string json;
  for (const std::string kind : {"rs", "ag"}) {
    for (int64_t numel :
         {int64_t{4096}, int64_t{786432}, int64_t{3145728}}) { // 16 KiB, 3 and 12 MiB
      at::Tensor whole = kind == "rs" ? at::randn({numel}) : at::empty({numel});
      at::Tensor shard = kind == "rs" ? at::empty({numel / world}) : at::randn({numel / world});
      std::vector<double> ms;
      for (int i = 0; i < 23; ++i) {
        dtensor::barrier(group);
        const auto t0 = std::chrono::steady_clock::now();
        if (kind == "rs") {
          dtensor::reduce_scatter_tensor_into(shard, whole, dtensor::ReduceOp::Sum, group);
        } else {
          dtensor::all_gather_into_tensor(whole, shard, group);
        }
        const auto t1 = std::chrono::steady_clock::now();
        if (i >= 3) {
          ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
      }
      std::sort(ms.begin(), ms.end());
      json += (json.empty() ? "" : ", ") + std::string("\"") + kind + ":" + std::to_string(numel) +
              "\": " + std::to_string(ms[ms.size() / 2]);
    }
  }
  { // DTensor::from_local of a 2x2 tensor as Shard(0) without a shape (the agreement on sizes)
    const auto mesh = dtensor::init_device_mesh(c10::kCPU, {world}, {"x"});
    const at::Tensor local = at::ones({2, 2});
    std::vector<double> ms;
    for (int i = 0; i < 23; ++i) {
      dtensor::barrier(group);
      const auto t0 = std::chrono::steady_clock::now();
      dtensor::DTensor::from_local(local, mesh, {dtensor::Placement::shard(0)});
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= 3) {
        ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
    }
    std::sort(ms.begin(), ms.end());
    json += ", \"fl:4\": " + std::to_string(ms[ms.size() / 2]);
  }
  if (dtensor::get_rank() == 0) {
    std::printf("RESULT {%s}\n", json.c_str());
    std::fflush(stdout);
  }
  dtensor::destroy_process_group();
  return 0;
}
