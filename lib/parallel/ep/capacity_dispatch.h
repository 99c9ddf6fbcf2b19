#pragma once

// Expert parallelism's capacity dispatch (lib/parallel/ep/capacity_dispatch.cpp): fixed-size
// buffers per (source, destination) pair, the counts in the payload, nothing read by the host.
// [Note: capacity dispatch] there.
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include <dtensor/expert_parallel.h>
#include <dtensor/process_group.h>

#include "parallel/ep/async_all_to_all.h"
#include "parallel/ep/float8_dispatch.h"

namespace dtensor::detail::ep {

// C for a call: ceil(factor * max_rows / ep), at least 1, at most max_rows (0 when max_rows is).
int64_t capacity_of(int64_t max_rows, double factor, int64_t ep);

// The sender's side of a call: this rank's rows laid out for every destination, and where they
// come back.
struct CapacitySend {
  int64_t capacity = 0;    // C
  at::Tensor rows;         // [ep, C, D]: destination j's first rows in expert order, zeros after
  at::Tensor capped;       // [ep, E/ep] rows of those slots for each of j's experts (int64)
  at::Tensor return_index; // [N] this rank's row -> its slot in the returned [ep*C] (+1: none)
  at::Tensor overflow;     // [ep] rows beyond C this rank routed to each ep rank
  at::Tensor counts;       // [E] this rank's rows per expert, as routed
  at::Tensor rows_and_counted; // [2] the call's rows and what its counts add up to
};
CapacitySend capacity_send(const at::Tensor& x, const at::Tensor& counts, int64_t capacity,
                           const Group& group);

// The receiver's side of one exchange of the slots [begin, end) of every (source, destination)
// pair: the whole capacity, or a chunk of it ([Note: overlapped chunks] in expert_parallel.cpp).
struct CapacityChunk {
  int64_t slots = 0;       // end - begin
  at::Tensor source_major; // [ep*slots] received (source-major) row -> its expert-major row
  at::Tensor local_counts; // [E/ep] rows received for each local expert (int64, device)
};
// Exchanges the slots [begin, end): this rank's experts' rows [ep*slots, D], expert-major, the
// padding last. `float8`: the rows travel as float8.
std::pair<at::Tensor, CapacityChunk> capacity_exchange(const CapacitySend& send, int64_t begin,
                                                       int64_t end, bool float8,
                                                       const Group& group);

// The same exchange issued (start) and completed (finish) apart.
struct StartedChunk {
  PendingAllToAll a2a;          // rows in their dtype
  PendingFloat8AllToAll float8; // or as float8
  bool as_float8 = false;
  int64_t header = 0, slots = 0, local = 0; // header rows, slots, experts per rank
};
StartedChunk start_capacity_exchange(const CapacitySend& send, int64_t begin, int64_t end,
                                     bool float8, const Group& group);
std::pair<at::Tensor, CapacityChunk> finish_capacity_exchange(StartedChunk& started,
                                                              const Group& group);
// The experts' rows of a chunk [ep*slots, D] sent back (source-major), issued.
PendingAllToAll start_capacity_return(const at::Tensor& y, const CapacityChunk& chunk,
                                      const Group& group);
// Every chunk's returned rows, in slot order, -> [N, D] on x's rank (rows beyond C: zeros).
at::Tensor capacity_gather(const CapacitySend& send, const std::vector<at::Tensor>& returned);

// What one capacity call of a single exchange keeps between its dispatch and its combine.
struct CapacityPlan {
  CapacitySend send;
  CapacityChunk chunk;
};

// x [N, D] (rows in expert order, counts [E] of them) -> this rank's experts' rows [ep*C, D],
// expert-major, the padding last; and the plan. `float8`: the rows travel as float8.
std::pair<at::Tensor, CapacityPlan> capacity_dispatch(const at::Tensor& x, const at::Tensor& counts,
                                                      int64_t capacity, bool float8,
                                                      const Group& group);
// y [ep*C, D] (as dispatch ordered) -> [N, D] on x's rank; rows beyond capacity get zeros.
at::Tensor capacity_combine(const at::Tensor& y, const CapacityPlan& plan, const Group& group);

// EpOverflow::Refuse: a call's overflow kept until checked, on every rank of `group` alike.
struct OverflowRecord {
  std::string layer;
  Group group;
  at::Tensor overflow, counts, rows_and_counted; // as in CapacitySend
  int64_t capacity = 0, max_rows = 0;
  double factor = 0;
};
// Kept unless in a backward (an activation checkpoint's recompute: the forward recorded it).
void record_overflow(OverflowRecord record);
// The records so far, checked and cleared: one all-gather per ep group, then a refusal naming
// the first call that overflowed (the same text on every rank of its group). `when`: "at the
// end of the backward" or "at the call".
void check_overflow(const char* when);
// In a backward: the check queued as its last callback (once per backward).
void queue_overflow_check();

// Rows received and dropped by capacity calls, summed on the host when asked (ep_stats()).
void add_device_rows(const at::Tensor& received, const at::Tensor& dropped);
std::pair<int64_t, int64_t> take_device_rows();

} // namespace dtensor::detail::ep
