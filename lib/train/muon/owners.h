#pragma once

// Muon's owner exchange (include/dtensor/muon.h): every matrix's update gathered whole to one
// owner rank, orthogonalised there, the pieces sent back. [Note: Muon's owners] in owners.cpp.
#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/muon.h>
#include <dtensor/process_group.h>

namespace dtensor::detail::muon {

struct NewtonSchulz {
  std::tuple<double, double, double> coefficients;
  int64_t steps = 5;
  double eps = 1e-7;
};

// torch.optim.Muon's orthogonalisation of one matrix, in bf16 (its input is bf16 already).
at::Tensor newton_schulz(const at::Tensor& update, const NewtonSchulz& ns);

// A rank's piece of a matrix: rows [r0, r0 + rows) x cols [c0, c0 + cols).
struct Box {
  int64_t r0 = 0, c0 = 0, rows = 0, cols = 0;
  int64_t numel() const { return rows * cols; }
};

// One matrix of a step: `piece` is this rank's part of its update (bf16, [rows, cols] of its
// box); after the exchange `result` is the same part of the orthogonalised update.
struct Matrix {
  int64_t rows = 0, cols = 0;
  NewtonSchulz ns;
  std::vector<Box> boxes; // per group rank
  at::Tensor piece;
  at::Tensor result;
};

// The matrices sharded over one group: owners chosen, one all-to-all to them, Newton-Schulz on
// each owner, one all-to-all back. Fills every matrix's `result`.
optim::MuonExchange exchange(std::vector<Matrix>& matrices, const Group& group);

} // namespace dtensor::detail::muon
