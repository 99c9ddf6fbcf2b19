#pragma once

// Expert parallelism's token exchange (lib/parallel/ep/token_dispatch.cpp): the counts, the
// plan they give, and the two differentiable all-to-alls that move rows to the experts' ranks
// and back. [Note: the token exchange] in token_dispatch.cpp.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp> // CountsExchange holds a Work

#include <dtensor/collectives.h>
#include <dtensor/process_group.h>

namespace dtensor::detail::ep {

// One exchange of counts: `sent` [E] int64 (rows for each expert), `received` [ep, E/ep] (the
// rows each ep rank sends to each of this rank's experts), complete once `work` is waited on.
struct CountsExchange {
  at::Tensor sent;
  at::Tensor received;
  Work work;
};
CountsExchange start_counts_exchange(const at::Tensor& counts, const Group& group, bool async);

// What one call moves, from both ranks' counts.
struct ExchangePlan {
  std::vector<int64_t> send_splits; // rows to each ep rank, in the input's (expert) order
  std::vector<int64_t> recv_splits; // rows from each ep rank
  at::Tensor order;                 // expert-major position -> received row
  at::Tensor inverse;               // received row -> expert-major position
  at::Tensor local_counts;          // [E/ep] rows for each of this rank's experts, int64
};
ExchangePlan plan_exchange(const at::Tensor& counts, const at::Tensor& received);

// x [N, D] (rows in expert order) -> this rank's experts' rows [R, D], expert-major.
// `float8`: the rows travel as float8 ([Note: float8 dispatch] in float8_dispatch.cpp).
at::Tensor dispatch(const at::Tensor& x, const ExchangePlan& plan, bool float8, const Group& group);
// y [R, D] (expert-major, as dispatch gave) -> [N, D] back in x's order on x's rank.
at::Tensor combine(const at::Tensor& y, const ExchangePlan& plan, const Group& group);

// The differentiable all-to-all; `checked`: agree on the splits first (the public entry).
at::Tensor all_to_all_autograd(const at::Tensor& input, const std::vector<int64_t>& out_splits,
                               const std::vector<int64_t>& in_splits, const Group& group,
                               bool checked);

} // namespace dtensor::detail::ep
