#pragma once

// Expert parallelism's float8 dispatch (lib/parallel/ep/float8_dispatch.cpp): the rows cast to
// float8 before the dispatch all-to-all and back after. [Note: float8 dispatch] there.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <dtensor/process_group.h>

namespace dtensor::detail::ep {

// Bytes of one row of D values on the wire: D float8 values and their fp32 scale.
inline int64_t float8_row_bytes(int64_t d) {
  return d + 4;
}

// The received rows and, when a header was sent, the received header.
struct Float8Received {
  at::Tensor rows;   // [R, D] in x's dtype
  at::Tensor header; // [ep, Hb, D + 4] uint8, or undefined
};

// x [M, D] -> every row cast to float8 e4m3 with its own power-of-two fp32 scale and sent by one
// all-to-all of uint8 rows [M, D + 4] (`out_splits` / `in_splits` in rows; empty: equal), then
// back in x's dtype. `header` [ep, Hb, D + 4] uint8 (capacity dispatch's counts), when defined,
// goes first to each rank (equal splits). Differentiable in x: the gradient in x's dtype by the
// inverse all-to-all, straight through the cast.
Float8Received float8_all_to_all(const at::Tensor& x, const at::Tensor& header,
                                 const std::vector<int64_t>& out_splits,
                                 const std::vector<int64_t>& in_splits, const Group& group);

// The same exchange issued and waited for apart ([Note: overlapped all-to-alls] in
// async_all_to_all.cpp), equal splits: wait() gives what float8_all_to_all returns. The
// gradient's all-to-all (in x's dtype) is issued where the rows' gradient arrives and waited for
// where x's is taken.
struct Float8AsyncState;
class PendingFloat8AllToAll {
 public:
  PendingFloat8AllToAll() = default;
  PendingFloat8AllToAll(at::Tensor token, c10::intrusive_ptr<Float8AsyncState> state);
  Float8Received wait();

 private:
  at::Tensor token_; // carries the graph from x to the rows
  c10::intrusive_ptr<Float8AsyncState> state_;
};
PendingFloat8AllToAll start_float8_all_to_all(const at::Tensor& x, const at::Tensor& header,
                                              const Group& group);

} // namespace dtensor::detail::ep
