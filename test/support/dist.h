#pragma once

// Helpers shared by the multi-rank tests.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <dtensor/all.h>

namespace dtensor::testing {

inline int rank() { return dtensor::get_rank(); }
inline int world() { return dtensor::get_world_size(); }
// The collectives a redistribution or fully_shard issues over a group of `group_size` ranks:
// `n`, or none on one rank ([Note: one-rank mesh dimensions communicate nothing],
// transitions.cpp; [Note: one-rank shard groups alias], lib/parallel/fsdp/param_group.cpp).
inline int64_t over(int64_t group_size, int64_t n) { return group_size > 1 ? n : 0; }

// cuda when the run uses NCCL (a GPU visible and a CUDA build), cpu otherwise.
inline c10::DeviceType device_type() {
  return dtensor::get_backend() == dtensor::BackendType::Nccl ? c10::DeviceType::CUDA
                                                              : c10::DeviceType::CPU;
}

inline at::TensorOptions options(at::ScalarType dtype = at::kFloat) {
  auto device = device_type() == c10::DeviceType::CUDA ? dtensor::default_device()
                                                       : at::Device(at::kCPU);
  return at::TensorOptions().dtype(dtype).device(device);
}

// A tensor from host values, on the test device.
inline at::Tensor tensor(const std::vector<double>& values, at::ScalarType dtype = at::kFloat) {
  return at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(options(dtype));
}

inline bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::equal(a.cpu(), b.cpu());
}

// Same shape and values within tolerance (compared in double, on the host).
inline bool close(const at::Tensor& a, const at::Tensor& b, double rtol = 1e-5, double atol = 1e-6) {
  return a.sizes() == b.sizes() &&
         at::allclose(a.cpu().to(at::kDouble), b.cpu().to(at::kDouble), rtol, atol);
}

// A directory the ranks of this job share (they run on one machine), emptied: `name` under
// <build dir or tmp>/<prefix>-w<world size>. Collective (a barrier after rank 0 clears it).
inline std::string fresh_shared_dir(const std::string& prefix, const std::string& name) {
  namespace fs = std::filesystem;
  const char* base = std::getenv("MESON_BUILD_ROOT");
  const fs::path root = fs::path(base != nullptr ? base : fs::temp_directory_path().string()) /
                        (prefix + "-w" + std::to_string(world()));
  const fs::path dir = root / name;
  if (rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(root);
  }
  dtensor::barrier(dtensor::world_group());
  return dir.string();
}

} // namespace dtensor::testing
