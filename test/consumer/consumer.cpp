// Built by CMake from dtensor's pkg-config file; run alone (a world of one rank).
#include <iostream>

#include <ATen/ATen.h>

#include <dtensor/all.h>

int main() {
  dtensor::init_process_group();
  auto mesh = dtensor::init_device_mesh(c10::kCPU, {1}, {"dp"});
  auto t = at::full({3}, 2.0);
  dtensor::CommDebugMode mode;
  dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, mesh.get_group());
  std::cout << "consumer: sum=" << t.sum().item<float>()
            << " all_reduce=" << mode.count("dp", dtensor::CollectiveKind::AllReduce) << "\n";
  return 0;
}
