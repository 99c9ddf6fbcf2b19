#pragma once

// DTensor helpers shared by the tests that judge dtensor against the plain op on the full
// tensor: the full value of a tensor, and this rank's piece of a full tensor built without
// dtensor's own redistribution.
#include <algorithm>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/modules/container/sequential.h>

#include <dtensor/all.h>

#include "support/dist.h"

namespace dtensor::testing {

// The full (global) value of a DTensor; a plain tensor detached. No autograd recording.
inline at::Tensor full_value(const at::Tensor& t) {
  c10::NoGradGuard no_grad;
  return dtensor::is_dtensor(t) ? dtensor::DTensor(t).full_tensor() : t.detach();
}

// Equal within 1e-4, relative to the reference's largest magnitude (at least 1).
inline bool near(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(1.0, b.abs().max().item<double>());
  return close(a, b, 1e-4, 1e-4 * scale);
}

// The meshes of the randomized tests: 1-D over the world, and every 2-D factorisation of
// it (on 4 ranks 2x2 and the 3-D 2x1x2 and 1x2x2 too; on 8 ranks 2x2x2 and 4x2; on 1 rank
// a 1x1).
inline std::vector<dtensor::DeviceMesh> property_meshes() {
  const int w = dtensor::get_world_size();
  const auto type = dtensor::get_backend() == dtensor::BackendType::Nccl ? c10::DeviceType::CUDA
                                                                         : c10::DeviceType::CPU;
  std::vector<dtensor::DeviceMesh> out{dtensor::init_device_mesh(type, {w}, {"x"})};
  if (w == 4) {
    out.push_back(dtensor::init_device_mesh(type, {2, 2}, {"a", "b"}));
    out.push_back(dtensor::init_device_mesh(type, {2, 1, 2}, {"p", "q", "r"}));
    out.push_back(dtensor::init_device_mesh(type, {1, 2, 2}, {"u", "v", "w"}));
  } else if (w == 8) {
    out.push_back(dtensor::init_device_mesh(type, {2, 2, 2}, {"r", "s", "t"}));
    out.push_back(dtensor::init_device_mesh(type, {4, 2}, {"a", "b"}));
  } else if (w == 2) {
    out.push_back(dtensor::init_device_mesh(type, {1, 2}, {"a", "b"}));
    out.push_back(dtensor::init_device_mesh(type, {2, 1}, {"c", "d"}));
  } else {
    out.push_back(dtensor::init_device_mesh(type, {1, 1}, {"a", "b"}));
  }
  return out;
}

// This rank's piece of `full` laid out as `placements` on `mesh` (Shard placements slice;
// Partial placements keep the whole value, for the caller to split), computed from the
// chunk arithmetic alone, so that it can judge dtensor's redistribution.
inline at::Tensor local_piece(const at::Tensor& full, const dtensor::DeviceMesh& mesh,
                              const dtensor::Placements& placements) {
  dtensor::DTensorSpec spec;
  spec.mesh = mesh;
  for (const auto& p : placements) {
    spec.placements.push_back(p.normalized(full.dim()));
  }
  spec.shape = full.sizes().vec();
  spec.stride = dtensor::contiguous_strides(spec.shape);
  spec.dtype = full.scalar_type();
  auto offset = spec.local_offset();
  auto shape = spec.local_shape();
  at::Tensor local = full;
  for (int64_t d = 0; d < full.dim(); ++d) {
    local = local.narrow(d, offset[static_cast<size_t>(d)], shape[static_cast<size_t>(d)]);
  }
  return local.contiguous().clone();
}

// The C++ port of MLPStack.parallelize(tp_mesh, dp_mesh, use_activation_checkpointing=False,
// reshard_after_forward) from common_fsdp.py: in_proj colwise, out_proj rowwise
// (the last one to Shard(1)), the LayerNorm sequence-parallel; fully_shard on each MLP over
// dp, then the root. `s` is mlp_stack(dim, /*with_seq_parallel=*/true).
inline std::vector<dtensor::FSDPModule> parallelize_mlp_stack(torch::nn::Sequential& s,
                                                              const dtensor::DeviceMesh& tp,
                                                              const dtensor::DeviceMesh& dp,
                                                              bool reshard_after_forward) {
  using dtensor::ColwiseParallel;
  using dtensor::RowwiseParallel;
  dtensor::parallelize_module(
      *s, tp,
      dtensor::ParallelizePlan{
          {"*.in_proj", ColwiseParallel().use_local_output(false)},
          {"[01].out_proj", RowwiseParallel().use_local_output(false)},
          {"2.out_proj", RowwiseParallel().output_layouts(dtensor::Shard(1))},
          {"3", dtensor::SequenceParallel(1)},
      });
  std::vector<dtensor::FSDPModule> units;
  auto opts = dtensor::FullyShardOptions().mesh(dp).reshard_after_forward(reshard_after_forward);
  for (size_t i = 0; i < 3; ++i) { // not the LayerNorm
    units.push_back(dtensor::fully_shard(*s[i], opts));
  }
  units.push_back(dtensor::fully_shard(*s, dtensor::FullyShardOptions().mesh(dp)));
  return units;
}

} // namespace dtensor::testing
