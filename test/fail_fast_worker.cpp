// A job that goes wrong on purpose, run by fail_fast.py under torchrun:
//   throw: rank 1 throws before a collective the other ranks are already waiting in;
//   stall: rank 1 never joins the collective (it sleeps), the others must time out.
// Either way every rank must be gone, and the job failed, well within the timeout.
#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>

#include <ATen/ATen.h>

#include <dtensor/all.h>

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[1], "throw") != 0 && std::strcmp(argv[1], "stall") != 0)) {
    std::cerr << "usage: fail_fast_worker throw|stall TIMEOUT_SECONDS\n";
    return 2;
  }
  const bool stall = std::strcmp(argv[1], "stall") == 0;
  const auto timeout = std::chrono::seconds(std::atoi(argv[2]));
  try {
    dtensor::init_process_group(dtensor::ProcessGroupOptions().timeout(timeout));
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
    std::cerr << "rank " << (dtensor::is_initialized() ? dtensor::get_rank() : -1)
              << " error: " << e.what() << std::endl;
    return 1;
  }
}
