// A 4-rank job whose last rank goes wrong on purpose, run by flight_recorder.py under torchrun
// with DTENSOR_FLIGHT_RECORDER_DIR set. Five all-reduces of four floats over the world, but
// the last rank
//   skip:      skips the fourth, then stays busy elsewhere (it sleeps): the others time out
//              in their fifth, torchrun stops it, and its record is written on SIGTERM;
//   mismatch:  calls an all-gather in place of the fourth: the agreement on sizes finds it
//              at once, on every rank ([Note: agreeing on sizes]);
//   mismatch-raw: the same with the agreement off (DTENSOR_AGREE_SIZES=0): Gloo itself
//              fails or times out.
#include <chrono>
#include <iostream>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include <dtensor/all.h>

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode != "skip" && mode != "mismatch" && mode != "mismatch-raw") {
    std::cerr << "usage: flight_recorder_worker skip|mismatch|mismatch-raw TIMEOUT_SECONDS\n";
    return 2;
  }
  try {
    dtensor::init_process_group(
        dtensor::ProcessGroupOptions().timeout(std::chrono::seconds(std::atoi(argv[2]))));
    const dtensor::Group world = dtensor::world_group();
    const bool odd_one = dtensor::get_rank() == dtensor::get_world_size() - 1;
    for (int i = 0; i < 5; ++i) {
      at::Tensor t = at::ones({4});
      if (odd_one && i == 3 && mode == "skip") {
        continue;
      }
      if (odd_one && i == 3) {
        at::Tensor out = at::empty({4 * world.size()});
        dtensor::all_gather_into_tensor(out, t, world);
        continue;
      }
      dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, world);
    }
    if (odd_one && mode == "skip") {
      std::this_thread::sleep_for(std::chrono::minutes(10));
    }
    std::cout << "rank " << dtensor::get_rank() << ": completed?!\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "rank " << (dtensor::is_initialized() ? dtensor::get_rank() : -1)
              << " error: " << e.what() << std::endl;
    return 1;
  }
}
