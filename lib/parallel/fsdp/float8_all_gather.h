#pragma once

// fully_shard's float8 all-gather ([Note: float8 all-gather] in float8_all_gather.cpp), for the
// weights convert_to_float8_training marks (include/dtensor/float8.h).
#include <string>

#include <ATen/core/Tensor.h>

namespace dtensor::detail {

struct FSDPParamGroup;

// `weight` (a Linear's parameter, not fully_shard yet) is to be gathered in float8 by the
// fully_shard unit that takes it; `name` for errors.
void mark_float8_all_gather(const at::Tensor& weight, const std::string& name);
// fully_shard: whether `param` was marked (the mark is used up).
bool take_float8_all_gather_mark(const at::Tensor& param);
bool gathers_float8(const FSDPParamGroup& group);
// The unit's all-gather input: each parameter's segment of the flat shard as bytes, 16-byte
// aligned, the float8 ones cast with their scales (computed first when not valid).
at::Tensor float8_all_gather_input(FSDPParamGroup& group);
// The gathered bytes (every rank's input, one after another) copied out into the unsharded
// parameters, the float8 ones dequantized into the parameter dtype.
void float8_copy_out(FSDPParamGroup& group, const at::Tensor& gathered);
// The scale fully_shard gathers `param` (a fully_shard parameter) with; undefined when it is
// not gathered in float8.
at::Tensor fsdp_float8_scale(const at::Tensor& param);

} // namespace dtensor::detail
