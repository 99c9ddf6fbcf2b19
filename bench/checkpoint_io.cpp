// Save and load throughput of dtensor::checkpoint (bench/checkpoint_io.py runs it alternately
// with PyTorch's dcp.save / dcp.load of the same state and prints the table).
//   torchrun --nproc-per-node N --no-python bench_checkpoint_io DIR MB [no-hash]
// State: MB megabytes of float32 in 16 MB tensors [4096, 1024], Shard(0) over all ranks, plus
// one replicated 1 MB tensor. Prints one line: "save_s load_s bytes" (rank 0), each time the
// slowest rank's, from a barrier to the end of the call (fsync included).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dtensor/all.h>
#include <dtensor/checkpoint.h>

#include "flags.h"

namespace {

double timed(const std::function<void()>& body) {
  dtensor::barrier(dtensor::world_group());
  const auto t0 = std::chrono::steady_clock::now();
  body();
  at::Tensor secs =
      at::full({1}, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               at::kDouble);
  return dtensor::all_reduce(secs, dtensor::ReduceOp::Max, dtensor::world_group()).item<double>();
}

} // namespace

int main(int argc, char** argv) {
  // No flags: the arguments are positional, DIR MB [no-hash].
  dtensor::cli::FlagTable table("bench_checkpoint_io", "bench/checkpoint_io.cpp");
  table.set_epilogue("arguments: DIR MB [no-hash] (the checkpoint's directory, its megabytes; "
                     "no-hash: no chunk hashes written or verified)\n");
  std::vector<std::string> args;
  table.parse(argc, argv, &args);
  for (const std::string& a : args) {
    if (a.rfind("--", 0) == 0) {
      table.fail("unknown flag " + a);
    }
  }
  if (args.size() != 2 && !(args.size() == 3 && args[2] == "no-hash")) {
    table.fail("takes DIR MB [no-hash]");
  }
  int64_t mb = 0;
  try {
    mb = dtensor::cli::FlagTable::parse_int(args[1]);
  } catch (const std::exception&) {
    table.fail("MB takes an integer, not '" + args[1] + "'");
  }
  at::set_num_threads(1);
  dtensor::init_process_group();
  const std::string dir = args[0];
  const int64_t tensors = std::max<int64_t>(1, mb / 16);
  auto mesh = dtensor::init_device_mesh(c10::DeviceType::CPU, {dtensor::get_world_size()});
  dtensor::StateDict state;
  dtensor::StateDict target;
  int64_t bytes = 0;
  for (int64_t i = 0; i < tensors; ++i) {
    at::manual_seed(static_cast<uint64_t>(i));
    state.insert("layers." + std::to_string(i) + ".weight",
                 dtensor::distribute_tensor(at::randn({4096, 1024}), mesh, {dtensor::Shard(0)}));
    target.insert("layers." + std::to_string(i) + ".weight",
                  dtensor::distribute_tensor(at::zeros({4096, 1024}), mesh, {dtensor::Shard(0)}));
    bytes += 4096 * 1024 * 4;
  }
  state.insert("norm.weight", at::ones({512, 512}));
  target.insert("norm.weight", at::zeros({512, 512}));
  bytes += 512 * 512 * 4;
  // Optional third argument "no-hash": save without hashes, load without verifying them
  // (what PyTorch's readers and writers do).
  const bool hash = args.size() < 3;
  const double save_s = timed([&] {
    dtensor::checkpoint::save(state, dir, dtensor::checkpoint::SaveOptions().checksums(hash));
  });
  const double load_s = timed([&] {
    dtensor::checkpoint::load(target, dir, dtensor::checkpoint::LoadOptions().verify(hash));
  });
  for (const auto& item : state) { // the load really happened
    if (!at::equal(dtensor::is_dtensor(item.value()) ? dtensor::DTensor(item.value()).to_local()
                                                     : item.value(),
                   dtensor::is_dtensor(target[item.key()])
                       ? dtensor::DTensor(target[item.key()]).to_local()
                       : target[item.key()])) {
      std::fprintf(stderr, "bench_checkpoint_io: %s differs after load\n", item.key().c_str());
      return 1;
    }
  }
  if (dtensor::get_rank() == 0) {
    std::printf("%.6f %.6f %lld\n", save_s, load_s, static_cast<long long>(bytes));
  }
  dtensor::destroy_process_group();
  return 0;
}
