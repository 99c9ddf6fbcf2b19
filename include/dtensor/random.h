#pragma once

// Random numbers that do not depend on the layout ([Note: layout-independent random
// numbers], docs/random.md). A random op on a DTensor (normal_, uniform_, bernoulli_,
// random_, exponential_, log_normal_, cauchy_, geometric_, bernoulli, dropout, the rand /
// randn factories) fills the global tensor as if it were one tensor on one process: element
// i (row-major over the global shape) of the op's draw comes from Philox4x32-10 with key
// `seed` and counter (op offset, i). Each rank computes the elements it holds, so the full
// tensor is the same on every mesh, world size and placement, replicas are equal and
// shards differ. Each random op advances the offset by one.
//
// Where the seed comes from:
//  - after dtensor::manual_seed(seed, mesh): from dtensor's own state (seed, offset), which
//    plain-tensor random ops never touch;
//  - otherwise: every DTensor random op draws its offset (one 64-bit draw) from LibTorch's
//    default CPU generator and uses that generator's current seed as key, so
//    torch::manual_seed(s) on every rank (PyTorch's contract) is enough, and reseeding it
//    restarts the sequence.
// A Generator passed to the op plays the part of the default CPU generator (it must be a CPU
// generator). A plain tensor passed to dtensor::normal_ and the others below is filled by the
// same rule, as the full tensor on a one-rank mesh: the reference for every layout.

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

#include <dtensor/device_mesh.h>

namespace dtensor {

// Seeds dtensor's random state for SPMD code over `mesh` (the calling rank must be in it).
// Every rank of the mesh must pass the same seed; no collective checks it.
void manual_seed(uint64_t seed, const DeviceMesh& mesh);

// dtensor's own random state: saved and restored around recomputation (activation
// checkpointing) and by checkpoints. `seeded` false: the default CPU generator is followed.
struct RngState {
  bool seeded = false;
  uint64_t seed = 0;
  uint64_t offset = 0;
};
RngState get_rng_state();
void set_rng_state(const RngState& state);

// [Note: batch slices]
// In data-parallel training a rank's activations are its slice of the global batch: plain
// tensors (FSDP, replicate) or DTensors over the other mesh dims (FSDP x TP). While a
// BatchShardGuard is alive on this thread, every random op treats the tensor it fills
// (plain, or a DTensor's global shape) as slice `index` of `count` equal slices along dim 0
// of the true global tensor, so dropout in a data-parallel step draws exactly the rows the
// one-process model draws for the same samples. Tensors of dim 0 (no batch) are unchanged.
class BatchShardGuard {
 public:
  BatchShardGuard(int64_t count, int64_t index);
  // Slices over the data-parallel mesh: count = its size, index = this rank's row-major
  // coordinate on it (the order in which the data loader hands out batch slices).
  explicit BatchShardGuard(const DeviceMesh& dp_mesh);
  ~BatchShardGuard();
  BatchShardGuard(const BatchShardGuard&) = delete;
  BatchShardGuard& operator=(const BatchShardGuard&) = delete;

 private:
  int64_t previous_count_;
  int64_t previous_index_;
};

// Plain tensors under the same rule (the one-rank reference): fills `t` as the full
// tensor of the next random op. DTensors go through their ATen ops (t.normal_(...)).
at::Tensor& normal_(at::Tensor& t, double mean = 0.0, double std = 1.0);
at::Tensor& uniform_(at::Tensor& t, double from = 0.0, double to = 1.0);
// torch.nn.init.trunc_normal_ (LibTorch's C++ init has none): normal values redrawn by
// inverse CDF inside [a, b]. Layout-independent on DTensors as well (uniform_ + pointwise).
at::Tensor& trunc_normal_(at::Tensor& t, double mean = 0.0, double std = 1.0, double a = -2.0,
                          double b = 2.0);
// Dropout for plain tensors and DTensors alike (training: zeroes with probability p, scales
// the rest by 1/(1-p); not training: the input).
at::Tensor dropout(const at::Tensor& input, double p, bool train);

} // namespace dtensor
