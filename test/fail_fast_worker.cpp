// A job that goes wrong on purpose, run by fail_fast.py under torchrun:
//   throw: rank 1 throws before a collective the other ranks are already waiting in;
//   stall: rank 1 never joins the collective (it sleeps), the others must time out.
//   pipe-throw / pipe-stall: the same in a pipeline schedule (run_pipeline below);
//   reshard-kill: rank 1, a source of a reshard, is killed (_exit) as the others start it;
//     every other rank must fail with the target it passed left as it was.
// Either way every rank must be gone, and the job failed, well within the timeout.
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <iostream>
#include <thread>

#include <unistd.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <dtensor/all.h>

namespace {

// A pipeline of one Linear stage per rank (1F1B, 4 microbatches) whose last stage goes wrong
// in its forward of microbatch 2: it throws (pipe-throw) or never returns (pipe-stall), while
// the previous stage waits for that microbatch's gradient.
void run_pipeline(bool stall) {
  const int world = dtensor::get_world_size();
  auto pp = dtensor::init_device_mesh(c10::kCPU, {world}, {"pp"}).get_group();
  const int me = dtensor::get_rank();
  auto layer = std::make_shared<torch::nn::LinearImpl>(4, 4);
  int calls = 0;
  dtensor::PipelineStage stage(me, layer, [&](const at::Tensor& x) {
    if (me == world - 1 && calls++ == 3) { // the shape probe, then microbatches 0, 1, 2
      if (stall) {
        std::this_thread::sleep_for(std::chrono::minutes(10));
      }
      throw std::runtime_error("stage " + std::to_string(me) + " fails on purpose");
    }
    return layer->forward(x);
  });
  auto order = dtensor::generate_schedule(dtensor::ScheduleKind::OneFOneB, world, 4);
  dtensor::PipelineSchedule schedule({stage}, pp, order, 4,
                                     [](const at::Tensor& y, const at::Tensor& t) {
                                       return (y - t).pow(2).sum();
                                     });
  schedule.step(at::ones({8, 4}), at::zeros({8, 4}));
  std::cout << "rank " << me << ": pipeline step completed without the last stage?!\n";
}

// FSDP over every rank -> Shard(1): rank 1 dies where the others enter reshard. The targets
// start at -1; a rank that sees its reshard fail checks they still are.
void run_reshard_kill() {
  const int world = dtensor::get_world_size();
  auto mesh = dtensor::init_device_mesh(c10::kCPU, {world}, {"dp"});
  dtensor::StateDict source, target;
  source.insert("w", dtensor::distribute_tensor(at::randn({8, 8}), mesh, {dtensor::Shard(0)},
                                                std::nullopt));
  target.insert("w", dtensor::distribute_tensor(at::full({8, 8}, -1.0), mesh,
                                                {dtensor::Shard(1)}, std::nullopt));
  auto t = at::ones({4});
  dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, mesh.get_group()); // all ranks healthy here
  if (dtensor::get_rank() == 1) {
    _exit(1);
  }
  try {
    dtensor::reshard(source, target);
  } catch (const dtensor::Error&) {
    const bool untouched =
        at::equal(dtensor::DTensor(target["w"]).to_local(),
                  at::full_like(dtensor::DTensor(target["w"]).to_local(), -1.0));
    // One write, so that the ranks' lines on the shared stderr do not interleave.
    std::cerr << ("rank " + std::to_string(dtensor::get_rank()) + ": reshard failed, targets " +
                  (untouched ? "untouched" : "HALF-WRITTEN") + "\n")
              << std::flush;
    throw;
  }
  std::cout << "rank " << dtensor::get_rank() << ": reshard completed without rank 1?!\n";
}

} // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode != "throw" && mode != "stall" && mode != "pipe-throw" && mode != "pipe-stall" &&
      mode != "reshard-kill") {
    std::cerr << "usage: fail_fast_worker throw|stall|pipe-throw|pipe-stall|reshard-kill "
                 "TIMEOUT_SECONDS\n";
    return 2;
  }
  const bool stall = mode == "stall" || mode == "pipe-stall";
  const auto timeout = std::chrono::seconds(std::atoi(argv[2]));
  try {
    dtensor::init_process_group(dtensor::ProcessGroupOptions().timeout(timeout));
    if (mode.rfind("pipe-", 0) == 0) {
      run_pipeline(stall);
      return 0;
    }
    if (mode == "reshard-kill") {
      run_reshard_kill();
      return 0;
    }
    auto mesh = dtensor::init_device_mesh(c10::kCPU, {dtensor::get_world_size()}, {"dp"});
    auto t = at::ones({4});
    dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, mesh.get_group()); // all ranks healthy here
    if (dtensor::get_rank() == 1) {
      if (stall) {
        std::this_thread::sleep_for(std::chrono::minutes(10));
      }
      throw std::runtime_error("rank 1 fails on purpose");
    }
    dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, mesh.get_group());
    std::cout << "rank " << dtensor::get_rank() << ": collective completed without rank 1?!\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << ("rank " + std::to_string(dtensor::is_initialized() ? dtensor::get_rank() : -1) +
                  " error: " + e.what() + "\n")
              << std::flush; // one write: ranks' lines do not interleave
    return 1;
  }
}
