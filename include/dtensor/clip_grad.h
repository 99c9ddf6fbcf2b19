#pragma once

// Gradient clipping over DTensor gradients: one all-reduce per mesh dimension, whatever the
// number of gradients. See docs/clip_grad_norm.md.
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/device_mesh.h>

namespace dtensor {

// The norm of order `norm_type` (any p > 0, inf, -inf, or 0 for the count of non-zeros) of
// all `tensors` together, as if every one were unsharded. DTensor inputs give a DTensor
// Replicate over the mesh spanning every mesh dimension they live on (one all-reduce per
// dimension: the local partial norms of all tensors are combined first); plain inputs
// only (no DTensor) give a plain tensor and no communication. The result has the inputs'
// dtype; the reduction runs in fp32. error_if_nonfinite: throw (host sync) on nan / inf.
//
// [Note: the norm over pipeline stages] Under pipeline parallelism each pipeline rank holds
// other parameters (its stages'). `pipeline`, a 1-D slice of the root mesh the gradients live
// on (mesh["pp"]; or a 1-D mesh of its own when the stages hold plain tensors), makes the
// norm cover every pipeline rank's gradients: the pipeline dimension counts as one more
// dimension every gradient is sharded over, so one all-reduce more, over it, and the result
// is Replicate over the union of the meshes including the pipeline dimension (torchtitan's
// clip_grad_norm_ with pp_mesh). Every rank of the pipeline takes part, with or without
// gradients. Order 0 is refused with a pipeline (its total counts tensors, which differ
// between stages).
//
// Tensors on meshes of different roots (experts on their own (dp_replicate, efsdp, ep) mesh
// beside the dense parameters' mesh), or on a mesh with a flattened dimension under a
// pipeline, are reduced by root: each root's partial with one all-reduce per dimension some
// of its tensors are sharded over, the partials combined on every rank, then one all-reduce
// over `pipeline` ([Note: gradients on several roots] in lib/train/clip_grad.cpp,
// torchtitan's _clip_grad_norm_with_ep). The result is then a plain tensor, the same on
// every rank.
at::Tensor get_total_norm(const std::vector<at::Tensor>& tensors, double norm_type = 2.0,
                          bool error_if_nonfinite = false, const DeviceMesh& pipeline = {});

// Scales every gradient of `parameters` by clamp(max_norm / (total_norm + 1e-6), max=1),
// on the device, without a host sync and without communication.
void clip_grads_with_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           const at::Tensor& total_norm);

// get_total_norm of the parameters' gradients, then clip_grads_with_norm_; returns the
// total norm (torch.nn.utils.clip_grad_norm_ semantics on DTensor gradients).
// `pipeline`: [Note: the norm over pipeline stages].
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           double norm_type = 2.0, bool error_if_nonfinite = false,
                           const DeviceMesh& pipeline = {});

} // namespace dtensor
