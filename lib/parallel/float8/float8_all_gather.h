#pragma once

// Float8's all-gather for fully_shard, as an all-gather extension
// (include/dtensor/fsdp_extension.h; [Note: float8 all-gather] in float8_all_gather.cpp).
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include <dtensor/fsdp_extension.h>

namespace dtensor::detail {

// The extension convert_to_float8_training registers on a weight it converts with
// enable_fsdp_float8_all_gather; `name` is the Linear's, for errors.
std::shared_ptr<AllGatherExtension> float8_all_gather_extension(const std::string& name);
// The scale fully_shard gathers `weight` (a fully_shard parameter) with; undefined when it is
// not gathered in float8.
at::Tensor float8_all_gather_scale(const at::Tensor& weight);
// Whether fully_shard keeps `weight` as its gathered float8 bits (not resharded after forward
// to a smaller group); its unit is unsharded then, as for any use in forward or backward.
bool float8_weight_kept(const at::Tensor& weight);

} // namespace dtensor::detail
