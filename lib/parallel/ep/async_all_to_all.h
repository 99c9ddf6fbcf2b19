#pragma once

// An all-to-all with autograd that is issued in one place and waited for in another, in forward
// and in backward alike (lib/parallel/ep/async_all_to_all.cpp): what lets expert parallelism run
// one chunk's experts while another chunk's rows are in flight. [Note: overlapped all-to-alls]
// there.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <dtensor/process_group.h>

namespace dtensor::detail::ep {

struct AsyncAllToAllState;

// Issued, not waited for: wait() gives the output (once). Dropping it unwaited waits.
class PendingAllToAll {
 public:
  PendingAllToAll() = default;
  PendingAllToAll(at::Tensor in_flight, c10::intrusive_ptr<AsyncAllToAllState> state);
  at::Tensor wait();

 private:
  at::Tensor in_flight_; // the output buffer, not to be read before the wait
  c10::intrusive_ptr<AsyncAllToAllState> state_;
};

// `input` [rows, ...] to every rank of `group` by `in_splits` (rows sent to each rank; empty:
// equal), received by `out_splits` (empty: equal). Differentiable in `input`: the gradient goes
// back by the inverse all-to-all, issued where the output's gradient arrives and waited for
// where the input's gradient is taken.
PendingAllToAll start_all_to_all(const at::Tensor& input, const std::vector<int64_t>& out_splits,
                                 const std::vector<int64_t>& in_splits, const Group& group);

} // namespace dtensor::detail::ep
