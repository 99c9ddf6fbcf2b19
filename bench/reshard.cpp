// A model's weights from FSDP over every rank to tensor-parallel replicas (TP 2) on the same
// ranks, three ways: reshard (point-to-point by the overlap plan), save-then-load (a dtensor
// checkpoint in a directory, --dir, then loaded into the target layout), and
// gather-and-broadcast (each tensor's full value on every rank, then each rank's piece cut
// out: what a full state dict exchange does). --tensors tensors of [--rows, --cols] fp32.
// Each way --rounds times, each timed between barriers; rank 0 prints a Markdown table: the
// median (min-max) ms and the bytes each way moves, summed over ranks (received from other
// ranks; for save-then-load, the files written).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dtensor/all.h>
#include <dtensor/reshard.h>

#include "bench_util.h"
#include "flags.h"

namespace {

struct Args {
  int64_t tensors = 8, rows = 1024, cols = 1024, rounds = 5;
  std::string dir = "/tmp/dtensor-bench-reshard";
};

Args parse(int argc, char** argv) {
  Args a;
  dtensor::cli::FlagTable("bench_reshard", "bench/reshard.cpp")
      .value("--tensors", "weights moved (8)", a.tensors)
      .value("--rows", "rows of each weight (1024)", a.rows)
      .value("--cols", "columns of each weight (1024)", a.cols)
      .value("--rounds", "timed rounds of each way (5)", a.rounds)
      .value("--dir", "save-then-load's checkpoint directory (/tmp/dtensor-bench-reshard)", a.dir)
      .parse(argc, argv);
  return a;
}

dtensor::StateDict layout(const Args& a, const dtensor::DeviceMesh& mesh,
                          const dtensor::Placements& placements, bool values) {
  dtensor::StateDict out;
  at::manual_seed(0);
  for (int64_t i = 0; i < a.tensors; ++i) {
    const at::Tensor full = values ? at::randn({a.rows, a.cols}) : at::zeros({a.rows, a.cols});
    out.insert("layers." + std::to_string(i) + ".weight",
               dtensor::distribute_tensor(full, mesh, placements, std::nullopt));
  }
  return out;
}

double sum_over_ranks(double v) {
  at::Tensor t = at::full({1}, v, at::kDouble);
  dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, dtensor::world_group());
  return t.item<double>();
}

// Median, min and max ms of `body`, and the bytes it sends (CommDebugMode, all ranks).
void row(const char* label, int64_t rounds, const std::function<double()>& body) {
  std::vector<double> ms;
  double bytes = 0;
  for (int64_t r = 0; r < rounds; ++r) {
    dtensor::barrier(dtensor::world_group());
    const auto start = std::chrono::steady_clock::now();
    bytes = body();
    dtensor::barrier(dtensor::world_group());
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  const double total = sum_over_ranks(bytes);
  if (dtensor::get_rank() == 0) {
    std::printf("| %s | %.1f (%.1f-%.1f) | %.0f |\n", label, bench::median(ms),
                *std::min_element(ms.begin(), ms.end()), *std::max_element(ms.begin(), ms.end()),
                total);
  }
}

} // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  const Args a = parse(argc, argv);
  dtensor::init_process_group();
  const int world = dtensor::get_world_size();
  const auto flat = dtensor::init_device_mesh(c10::kCPU, {world}, {"dp"});
  const auto grid = dtensor::init_device_mesh(c10::kCPU, {world / 2, 2}, {"replica", "tp"});
  const dtensor::StateDict source = layout(a, flat, {dtensor::Shard(0)}, true);
  const dtensor::StateDict target =
      layout(a, grid, {dtensor::Replicate(), dtensor::Shard(0)}, false);
  if (dtensor::get_rank() == 0) {
    std::printf("%d ranks, %lld tensors of %lld x %lld fp32, FSDP (Shard(0) over all) -> TP 2 "
                "replicas\n\n| way | ms | bytes moved, all ranks |\n| --- | ---: | ---: |\n",
                world, static_cast<long long>(a.tensors), static_cast<long long>(a.rows),
                static_cast<long long>(a.cols));
  }
  row("reshard", a.rounds,
      [&] { return static_cast<double>(dtensor::reshard(source, target).bytes_received); });
  row("gather-and-broadcast", a.rounds, [&] {
    dtensor::CommDebugMode mode;
    at::NoGradGuard no_grad;
    for (const auto& item : source) {
      const at::Tensor full = dtensor::DTensor(item.value()).full_tensor();
      const dtensor::DTensor t(target[item.key()]);
      t.to_local().copy_(
          dtensor::DTensor(dtensor::distribute_tensor(full, grid, t.placements(), std::nullopt))
              .to_local());
    }
    return static_cast<double>(mode.total_bytes_out() - mode.total_bytes_in());
  });
  row("save-then-load", a.rounds, [&] {
    // A save replaces the previous round's checkpoint and refuses anything else at `dir`.
    const std::string dir = a.dir + "-w" + std::to_string(world);
    dtensor::checkpoint::save(source, dir);
    dtensor::checkpoint::load(target, dir);
    double bytes = 0;
    for (const auto& f : std::filesystem::directory_iterator(dir)) {
      bytes += dtensor::get_rank() == 0 ? static_cast<double>(f.file_size()) : 0.0;
    }
    return bytes;
  });
  dtensor::destroy_process_group();
  return 0;
}
