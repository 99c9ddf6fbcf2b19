// Muon's owner exchange and Newton-Schulz (owners.h).
#include "train/muon/owners.h"

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>

#include <dtensor/collectives.h>

#include "internal/check.h"

namespace dtensor::detail::muon {

// [Note: Muon's owners]
// Muon orthogonalises each weight matrix's update whole, so a matrix sharded over a group of
// ranks is gathered to one of them, its owner, and its pieces sent back afterwards. Every rank
// computes the same plan from the parameters' specs alone (no communication to agree on it):
//  - the holders of a matrix are the group ranks whose piece of it is not empty; its owner is
//    the holder with the least Newton-Schulz cost so far (rows x cols x min(rows, cols)
//    summed), matrices taken from the costliest down (ties: the lower index, the lower rank).
//    A matrix whole on one rank (an expert under expert parallelism without efsdp) is owned by
//    that rank and moves nowhere;
//  - to the owners: one all_to_all_single over the group, each rank sending each owner its
//    pieces of that owner's matrices in matrix order; back: one more, each owner sending each
//    rank its piece of the orthogonalised matrices. Nothing moves where nothing has to (no
//    collective at all when every matrix is whole on its owner);
//  - the pieces travel in bf16, the dtype Newton-Schulz works in (PyTorch casts the whole
//    update to bf16 first): the cast before the exchange gives the owner the same bf16 matrix,
//    at half the bytes of fp32. The result is bf16 as PyTorch's.
// So per step and shard group: 2 all-to-alls whatever the number of matrices, and each rank
// sends 2 x (its elements of matrices it does not own) bytes each way.

at::Tensor newton_schulz(const at::Tensor& update, const NewtonSchulz& ns) {
  DTENSOR_CHECK(ns.steps < 100, "Muon: ns_steps must be below 100 (got {})", ns.steps);
  const auto [a, b, c] = ns.coefficients;
  const bool tall = update.size(0) > update.size(1);
  at::Tensor x = update.to(at::kBFloat16, /*non_blocking=*/false, /*copy=*/true);
  if (tall) {
    x = x.t();
  }
  x.div_(x.norm().clamp_min(ns.eps));
  for (int64_t i = 0; i < ns.steps; ++i) {
    const at::Tensor gram = x.mm(x.t());
    const at::Tensor poly = at::addmm(gram, gram, gram, b, c);
    x = at::addmm(x, poly, x, a);
  }
  return tall ? x.t() : x;
}

namespace {

double cost(const Matrix& m) {
  return static_cast<double>(m.rows) * static_cast<double>(m.cols) *
         static_cast<double>(std::min(m.rows, m.cols));
}

std::vector<int> choose_owners(const std::vector<Matrix>& matrices, int n,
                               optim::MuonExchange& out) {
  std::vector<size_t> order(matrices.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return cost(matrices[x]) > cost(matrices[y]); });
  std::vector<int> owner(matrices.size(), -1);
  out.matrices.assign(n, 0);
  out.cost.assign(n, 0.0);
  for (size_t i : order) {
    for (int r = 0; r < n; ++r) {
      if (matrices[i].boxes[r].numel() > 0 && (owner[i] < 0 || out.cost[r] < out.cost[owner[i]])) {
        owner[i] = r;
      }
    }
    DTENSOR_CHECK(owner[i] >= 0, "Muon: a matrix of {} x {} has no rank holding a piece of it",
                  matrices[i].rows, matrices[i].cols);
    out.matrices[owner[i]] += 1;
    out.cost[owner[i]] += cost(matrices[i]);
  }
  return owner;
}

at::Tensor box_of(const at::Tensor& whole, const Box& b) {
  return whole.narrow(0, b.r0, b.rows).narrow(1, b.c0, b.cols);
}

at::Tensor concatenated(const std::vector<at::Tensor>& parts) {
  return parts.empty() ? at::empty({0}, at::kBFloat16) : at::cat(parts);
}

} // namespace

optim::MuonExchange exchange(std::vector<Matrix>& matrices, const Group& group) {
  const int n = group.size();
  const int me = group.rank();
  optim::MuonExchange out;
  out.group = group.label();
  const std::vector<int> owner = choose_owners(matrices, n, out);
  int64_t moved = 0; // over the whole group: the same on every rank
  for (size_t i = 0; i < matrices.size(); ++i) {
    for (int s = 0; s < n; ++s) {
      moved += s == owner[i] ? 0 : matrices[i].boxes[s].numel();
    }
  }
  // To the owners.
  std::vector<int64_t> send(n, 0), recv(n, 0);
  std::vector<at::Tensor> parts;
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < matrices.size(); ++i) {
      if (owner[i] == j && j != me && matrices[i].boxes[me].numel() > 0) {
        parts.push_back(matrices[i].piece.reshape({-1}));
        send[j] += matrices[i].boxes[me].numel();
      }
      if (owner[i] == me && j != me) {
        recv[j] += matrices[i].boxes[j].numel();
      }
    }
  }
  const at::Tensor got = moved == 0
                             ? at::empty({0}, at::kBFloat16)
                             : dtensor::all_to_all_single(concatenated(parts), recv, send, group);
  // Whole on the owner, orthogonalised.
  std::vector<at::Tensor> whole(matrices.size());
  for (size_t i = 0; i < matrices.size(); ++i) {
    if (owner[i] == me) {
      whole[i] = at::empty({matrices[i].rows, matrices[i].cols}, at::kBFloat16);
    }
  }
  int64_t at_elem = 0;
  for (int s = 0; s < n; ++s) {
    for (size_t i = 0; i < matrices.size(); ++i) {
      const Box& b = matrices[i].boxes[s];
      if (owner[i] != me || b.numel() == 0) {
        continue;
      }
      const at::Tensor src =
          s == me ? matrices[i].piece : got.narrow(0, at_elem, b.numel()).view({b.rows, b.cols});
      at_elem += s == me ? 0 : b.numel();
      box_of(whole[i], b).copy_(src);
    }
  }
  for (size_t i = 0; i < matrices.size(); ++i) {
    if (owner[i] == me) {
      whole[i] = newton_schulz(whole[i], matrices[i].ns);
      matrices[i].result = box_of(whole[i], matrices[i].boxes[me]);
    }
  }
  // Back from the owners.
  std::vector<int64_t> back_send(n, 0), back_recv(n, 0);
  parts.clear();
  for (int s = 0; s < n; ++s) {
    for (size_t i = 0; i < matrices.size(); ++i) {
      const int64_t mine = matrices[i].boxes[me].numel();
      if (owner[i] == me && s != me && matrices[i].boxes[s].numel() > 0) {
        parts.push_back(box_of(whole[i], matrices[i].boxes[s]).reshape({-1}));
        back_send[s] += matrices[i].boxes[s].numel();
      }
      if (owner[i] == s && s != me) {
        back_recv[s] += mine;
      }
    }
  }
  const at::Tensor back =
      moved == 0 ? at::empty({0}, at::kBFloat16)
                 : dtensor::all_to_all_single(concatenated(parts), back_recv, back_send, group);
  at_elem = 0;
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < matrices.size(); ++i) {
      const Box& b = matrices[i].boxes[me];
      if (owner[i] == j && j != me && b.numel() > 0) {
        matrices[i].result = back.narrow(0, at_elem, b.numel()).view({b.rows, b.cols});
        at_elem += b.numel();
      }
    }
  }
  const auto total = [](const std::vector<int64_t>& v) {
    return std::accumulate(v.begin(), v.end(), int64_t{0});
  };
  out.bytes_to_owners = 2 * total(send);
  out.bytes_from_owners = 2 * total(back_recv);
  out.collectives = moved == 0 ? 0 : 2;
  return out;
}

} // namespace dtensor::detail::muon
