#pragma once

// Philox4x32-10 over tensors of element indices ([Note: layout-independent random numbers]
// in lib/tensor/random/random_ops.cpp). Element `i` of random op `offset` under key `seed`
// gets the four 32-bit words that ATen's at::philox_engine(seed, /*subsequence=*/i,
// /*offset=*/offset) returns first: counter (offset_lo, offset_hi, i_lo, i_hi).

#include <array>
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace dtensor::detail {

// Four int64 tensors shaped like `index`, each holding one 32-bit word in [0, 2^32).
using PhiloxWords = std::array<at::Tensor, 4>;

// `index`: int64, non-negative. CPU tensors are drawn by a loop over at::philox_engine;
// other devices by the same rounds written as int64 tensor ops (philox_words_by_ops).
PhiloxWords philox_words(const at::Tensor& index, uint64_t seed, uint64_t offset);

// The tensor-op form on any device, exact (no product overflows int64: [Note: Philox
// in int64 tensor ops]). The CPU analogue of the GPU path: tests compare it with the loop.
PhiloxWords philox_words_by_ops(const at::Tensor& index, uint64_t seed, uint64_t offset);

} // namespace dtensor::detail
