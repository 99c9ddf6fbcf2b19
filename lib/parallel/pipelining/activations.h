#pragma once

// What travels between pipeline stages ([Note: DTensor activations] in activations.cpp).
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/device_mesh.h>
#include <dtensor/placement.h>

namespace dtensor::detail {

// A stage's input or output: the dtype and local sizes (what a transfer carries and a
// receive buffer is made of), and for a DTensor its global sizes and placements.
struct StageShape {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  bool dtensor = false;
  std::vector<int64_t> global;
  Placements placements;
  bool operator==(const StageShape& other) const = default;
  std::string
  str() const; // "Float[2, 4, 64]", "DTensor Float[2, 8, 64] (Shard(1)), local [2, 4, 64]"
};

StageShape shape_of(const at::Tensor& t);
// A fixed-length int64 tensor holding a StageShape, and back (the first step's exchange).
constexpr int64_t kShapeMetaLen = 40;
at::Tensor encode_shape(const StageShape& s);
// Where a shape message lives ([Note: pipeline buffers on the rank's device]): the rank's
// device, but the host in a simulated world, whose fake backend carries host values only
// ([Note: shapes across simulated stages] in lib/mesh/backend_fake.cpp).
c10::Device shape_message_device();
StageShape decode_shape(const at::Tensor& t);

// What a transfer of `t` carries: a DTensor's local tensor, else `t` (contiguous, detached).
at::Tensor wire_of(const at::Tensor& t);
// A received tensor as the stage takes it: for a DTensor shape, a DTensor on `mesh` with the
// shape's placements and global sizes (no communication). `who` names the stage for errors.
at::Tensor from_wire(const at::Tensor& local, const StageShape& s, const DeviceMesh& mesh,
                     const std::string& who);
// The gradient of an activation of shape `s`, to send back: a DTensor gradient is first
// redistributed to the activation's placements (it may come back Partial), so that the
// sender rebuilds it with its output's layout.
at::Tensor as_grad_of(const at::Tensor& grad, const StageShape& s); // without the wire
at::Tensor grad_to_wire(const at::Tensor& grad, const StageShape& s);
// A DTensor's mesh; an undefined mesh for a plain tensor.
DeviceMesh mesh_of(const at::Tensor& t);

} // namespace dtensor::detail
