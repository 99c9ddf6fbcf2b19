#pragma once

#include <string>

#include <ATen/core/Tensor.h>

namespace dtensor {

// [Note: visualize_sharding] PyTorch's torch.distributed.tensor.debug.visualize_sharding for
// 1-D and 2-D DTensors: which rank holds which block, as the table PyTorch prints (tabulate's
// "simple" layout, blocks as "Row a-b" x "Col c-d", a 1-D tensor as one column, each cell
// "<device>:<ranks>" in mesh order; Replicate and Partial hold the whole dimension).
//
// sharding_table() returns that text on every rank (from the spec alone: no collective); an
// empty tensor gives "". visualize_sharding() prints it, plus a newline, like PyTorch: only
// on the rank whose coordinate is 0 on every mesh dimension, nothing for an empty tensor;
// `header`, when not empty, is printed on its own line first (PyTorch's is accepted and
// ignored). Plain tensors and tensors of 3 or more dimensions are refused with the shape.
std::string sharding_table(const at::Tensor& dtensor);
void visualize_sharding(const at::Tensor& dtensor, const std::string& header = "");

} // namespace dtensor
