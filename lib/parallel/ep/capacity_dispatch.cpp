// Expert parallelism's capacity dispatch (capacity_dispatch.h).
#include "parallel/ep/capacity_dispatch.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/graph_task.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "parallel/end_of_backward.h"
#include "parallel/ep/async_all_to_all.h"
#include "parallel/ep/float8_dispatch.h"
#include "parallel/ep/token_dispatch.h"

namespace dtensor::detail::ep {

// [Note: capacity dispatch]
// The variable dispatch sizes its all-to-all from the counts, so the host reads them (on a GPU,
// a device-to-host synchronisation per MoE layer). Here every size is fixed before any value
// exists: each rank sends each ep rank a buffer of H + C rows, H header rows holding the counts
// of the rows that follow for each of the receiver's experts (int64s in the rows' bytes) and C
// rows, the first of them this rank's rows for that rank in expert order, zeros after. All
// indices are computed on the device from the counts (searchsorted, cumsum, where; no nonzero,
// no item):
//  - sender: slot c of destination j holds row first[j] + c while c < min(sent[j], C), else a
//    zero row appended to x; rows past C are the overflow (the last of that destination's
//    experts' rows in expert order);
//  - receiver: row i from source s belongs to local expert searchsorted(cumsum(counts[s]), i);
//    its expert-major position is the start of block (expert, s) plus its place in it, and the
//    padding rows follow in order: a permutation of ep*C rows, so the index_select that orders
//    them and the one that orders them back are exact and their gradients too;
//  - combine: the experts' ep*C rows back in source-major order, one all-to-all of C rows per
//    pair, and each sent row read from its slot (a dropped row from an appended zero row).
// Forward 2 all-to-alls, backward 2 (the variable dispatch's gradients by the same equal splits).
// With float8 dispatch the rows travel as float8 bytes with their scales ([Note: float8
// dispatch] in float8_dispatch.cpp) and the header as bytes of those rows' width.
// Every rank must use the same C (the all-to-all's splits): C comes from max_rows and the factor,
// which the caller keeps the same on every rank. The rows past the grouped ones are padding: the
// grouped product leaves them unwritten, and no output or gradient of a real row reads them.

int64_t capacity_of(int64_t max_rows, double factor, int64_t ep) {
  if (max_rows <= 0) {
    return 0;
  }
  const auto c = static_cast<int64_t>(
      std::ceil(factor * static_cast<double>(max_rows) / static_cast<double>(ep)));
  return std::clamp<int64_t>(c, 1, max_rows);
}

namespace {

// Rows of `row_bytes` bytes that hold `local` int64s.
int64_t header_rows(int64_t local, int64_t row_bytes) {
  return (local * 8 + row_bytes - 1) / row_bytes;
}

// [ep, local] int64 -> `rows` zero rows of each rank's bytes, the int64s first: [ep, rows * w].
at::Tensor header_bytes(const at::Tensor& counts, int64_t rows, int64_t row_bytes) {
  const int64_t ep = counts.size(0);
  at::Tensor h = at::zeros({ep, rows * row_bytes}, counts.options().dtype(at::kByte));
  h.narrow(1, 0, counts.size(1) * 8).copy_(counts.contiguous().view(at::kByte));
  return h;
}

// A received header ([ep, ...], any dtype) -> the int64 counts [ep, local] in its first bytes.
at::Tensor counts_of(const at::Tensor& header, int64_t local) {
  const int64_t ep = header.size(0);
  return header.detach()
      .contiguous()
      .view({ep, -1})
      .view(at::kByte)
      .narrow(1, 0, local * 8)
      .contiguous()
      .view(at::kLong);
}

// The payload of one exchange: each rank's header of `capped` counts, then its `rows` [ep, C, D],
// in the rows' dtype; and the header's rows.
std::pair<at::Tensor, int64_t> payload_of(const at::Tensor& rows, const at::Tensor& capped) {
  const int64_t ep = rows.size(0), d = rows.size(2);
  const int64_t row_bytes = d * static_cast<int64_t>(rows.element_size());
  const int64_t h = header_rows(capped.size(1), row_bytes);
  at::Tensor header = header_bytes(capped, h, row_bytes).view(rows.scalar_type()).view({ep, h, d});
  return {at::cat({header, rows}, 1).flatten(0, 1), h};
}

// A received payload -> the counts [ep, local] and the rows [ep*C, D].
std::pair<at::Tensor, at::Tensor> parse_payload(const at::Tensor& received, int64_t ep, int64_t h,
                                                int64_t local) {
  const int64_t d = received.size(1);
  at::Tensor r = received.view({ep, -1, d});
  const int64_t capacity = r.size(1) - h;
  return {counts_of(r.narrow(1, 0, h), local),
          r.narrow(1, h, capacity).reshape({ep * capacity, d})};
}

// Sends `rows` [ep, C, D] with the header of `capped` counts before each rank's: the received
// counts [ep, local] and rows [ep*C, D], in x's dtype or, with float8, as float8 on the wire.
std::pair<at::Tensor, at::Tensor> exchange(const at::Tensor& rows, const at::Tensor& capped,
                                           bool float8, const Group& group) {
  const int64_t ep = rows.size(0), d = rows.size(2);
  const int64_t local = capped.size(1);
  if (float8) {
    const int64_t w = float8_row_bytes(d), h = header_rows(local, w);
    Float8Received r = float8_all_to_all(
        rows.flatten(0, 1), header_bytes(capped, h, w).view({ep, h, w}), {}, {}, group);
    return {counts_of(r.header, local), r.rows};
  }
  auto [payload, h] = payload_of(rows, capped);
  return parse_payload(all_to_all_autograd(payload, {}, {}, group, /*checked=*/false), ep, h,
                       local);
}

// Received row (source s, row i < C) -> its expert-major position among the ep*C rows.
at::Tensor expert_major_positions(const at::Tensor& got, int64_t capacity) {
  const int64_t ep = got.size(0), local = got.size(1);
  const auto idx = got.options();
  at::Tensor ends = got.cumsum(1);
  at::Tensor i = at::arange(capacity, idx).expand({ep, capacity}).contiguous();
  at::Tensor expert =
      at::searchsorted(ends, i, /*out_int32=*/false, /*right=*/true).clamp_max(local - 1);
  at::Tensor valid = (i < got.sum(1).unsqueeze(1)).flatten();
  at::Tensor by_expert = got.t().flatten(); // blocks (expert, source)
  at::Tensor block = by_expert.cumsum(0) - by_expert;
  at::Tensor source = at::arange(ep, idx).unsqueeze(1);
  at::Tensor into = block.index_select(0, (expert * ep + source).flatten()) + i.flatten() -
                    (ends - got).gather(1, expert).flatten();
  at::Tensor spare = got.sum() + (~valid).to(at::kLong).cumsum(0) - 1;
  return at::where(valid, into, spare);
}

} // namespace

CapacitySend capacity_send(const at::Tensor& x, const at::Tensor& counts, int64_t capacity,
                           const Group& group) {
  const int64_t ep = group.size(), local = counts.size(0) / ep, n = x.size(0), d = x.size(1);
  const auto idx = counts.options();
  CapacitySend p;
  p.capacity = capacity;
  p.counts = counts.detach();
  at::Tensor per = p.counts.view({ep, local});
  at::Tensor sent = per.sum(1);
  at::Tensor first = sent.cumsum(0) - sent;
  p.capped = at::minimum(per, (capacity - (per.cumsum(1) - per)).clamp_min(0));
  at::Tensor kept = p.capped.sum(1);
  p.overflow = sent - kept;
  // Sender: slot (j, c) <- row first[j] + c, or the appended zero row n.
  at::Tensor slot = at::arange(capacity, idx);
  // (Clamped: counts adding up to more than the rows read the zero row, never past it;
  // refused at the overflow check, [Note: counts that do not add up].)
  at::Tensor take =
      at::where(slot.unsqueeze(0) < kept.unsqueeze(1), first.unsqueeze(1) + slot.unsqueeze(0), n)
          .clamp_max(n);
  p.rows = at::cat({x, at::zeros({1, d}, x.options())})
               .index_select(0, take.flatten())
               .view({ep, capacity, d});
  // Where each of this rank's rows comes back: its destination's slot, or nowhere.
  at::Tensor dest =
      at::searchsorted(sent.cumsum(0), at::arange(n, idx), /*out_int32=*/false, /*right=*/true)
          .clamp_max(ep - 1);
  at::Tensor place = at::arange(n, idx) - first.index_select(0, dest);
  p.return_index = at::where(place < capacity, dest * capacity + place, ep * capacity);
  p.rows_and_counted = at::stack({at::full({}, n, idx), sent.sum()});
  return p;
}

namespace {

// The counts of the rows in slots [begin, end) of each destination, by its experts.
at::Tensor capped_in(const at::Tensor& capped, int64_t begin, int64_t end) {
  at::Tensor last = capped.cumsum(1);
  return last.clamp(begin, end) - (last - capped).clamp(begin, end);
}

// The receiver's side of a chunk from its counts and rows: the rows expert-major.
std::pair<at::Tensor, CapacityChunk> receive(const at::Tensor& got, const at::Tensor& mine,
                                             int64_t slots) {
  CapacityChunk c;
  c.slots = slots;
  c.source_major = expert_major_positions(got, slots);
  at::Tensor order = at::empty_like(c.source_major)
                         .scatter_(0, c.source_major,
                                   at::arange(c.source_major.numel(), c.source_major.options()));
  c.local_counts = got.sum(0);
  return {mine.index_select(0, order), std::move(c)};
}

} // namespace

std::pair<at::Tensor, CapacityChunk> capacity_exchange(const CapacitySend& send, int64_t begin,
                                                       int64_t end, bool float8,
                                                       const Group& group) {
  auto [got, mine] = exchange(send.rows.narrow(1, begin, end - begin),
                              capped_in(send.capped, begin, end), float8, group);
  return receive(got, mine, end - begin);
}

StartedChunk start_capacity_exchange(const CapacitySend& send, int64_t begin, int64_t end,
                                     bool float8, const Group& group) {
  const at::Tensor rows = send.rows.narrow(1, begin, end - begin);
  const at::Tensor capped = capped_in(send.capped, begin, end);
  StartedChunk started;
  started.slots = end - begin;
  started.local = send.capped.size(1);
  started.as_float8 = float8;
  if (float8) {
    const int64_t ep = rows.size(0), w = float8_row_bytes(rows.size(2));
    started.header = header_rows(started.local, w);
    started.float8 = start_float8_all_to_all(
        rows.flatten(0, 1), header_bytes(capped, started.header, w).view({ep, started.header, w}),
        group);
    return started;
  }
  auto [payload, h] = payload_of(rows, capped);
  started.header = h;
  started.a2a = start_all_to_all(payload, {}, {}, group);
  return started;
}

std::pair<at::Tensor, CapacityChunk> finish_capacity_exchange(StartedChunk& started,
                                                              const Group& group) {
  if (started.as_float8) {
    Float8Received r = started.float8.wait();
    return receive(counts_of(r.header, started.local), r.rows, started.slots);
  }
  auto [got, mine] = parse_payload(started.a2a.wait(), group.size(), started.header, started.local);
  return receive(got, mine, started.slots);
}

PendingAllToAll start_capacity_return(const at::Tensor& y, const CapacityChunk& chunk,
                                      const Group& group) {
  return start_all_to_all(y.index_select(0, chunk.source_major), {}, {}, group);
}

at::Tensor capacity_gather(const CapacitySend& send, const std::vector<at::Tensor>& returned) {
  const int64_t ep = send.rows.size(0);
  std::vector<at::Tensor> slots;
  for (const at::Tensor& r : returned) {
    slots.push_back(r.view({ep, -1, r.size(1)}));
  }
  at::Tensor back = slots.size() == 1 ? returned.front() : at::cat(slots, 1).flatten(0, 1);
  return at::cat({back, at::zeros({1, back.size(1)}, back.options())})
      .index_select(0, send.return_index);
}

std::pair<at::Tensor, CapacityPlan> capacity_dispatch(const at::Tensor& x, const at::Tensor& counts,
                                                      int64_t capacity, bool float8,
                                                      const Group& group) {
  CapacityPlan p;
  p.send = capacity_send(x, counts, capacity, group);
  auto [rows, chunk] = capacity_exchange(p.send, 0, capacity, float8, group);
  p.chunk = std::move(chunk);
  return {rows, std::move(p)};
}

at::Tensor capacity_combine(const at::Tensor& y, const CapacityPlan& plan, const Group& group) {
  at::Tensor back = all_to_all_autograd(y.index_select(0, plan.chunk.source_major), {}, {}, group,
                                        /*checked=*/false);
  return capacity_gather(plan.send, {back});
}

namespace {

struct Overflows {
  std::mutex mutex;
  std::vector<OverflowRecord> records;
  EndOfBackward end_of_backward;
  at::Tensor received, dropped; // running sums on the rows' device (no host read per call)
};

Overflows& overflows() {
  static Overflows* o = new Overflows(); // outlives static destructors that may still check
  return *o;
}

// [Note: counts that do not add up] The capacity path never reads the counts on the host, so
// it cannot refuse rows whose counts add up to another number at the call, as the variable
// path does: the sender's indices are clamped (nothing fails on one rank while the others wait
// in the all-to-all) and the mismatch travels with the overflow check, which names it first.
void refuse_uncounted(const std::vector<OverflowRecord>& records, const at::Tensor& host,
                      const char* when) {
  const int64_t ep = host.size(0), calls = host.size(1), width = host.size(2);
  for (int64_t c = 0; c < calls; ++c) {
    for (int64_t r = 0; r < ep; ++r) {
      const int64_t rows = host[r][c][width - 2].item<int64_t>();
      const int64_t counted = host[r][c][width - 1].item<int64_t>();
      DTENSOR_CHECK(rows == counted,
                    "ExpertParallel on {} (its experts call {} of the step): ep rank {} called "
                    "the experts with {} rows but counts adding up to {}; refused {}",
                    records[static_cast<size_t>(c)].layer, c + 1, r, rows, counted, when);
    }
  }
}

// The first overflowing call of one group's records, from every rank's [calls, ep + E + 2].
void refuse_first(const std::vector<OverflowRecord>& records, const at::Tensor& all,
                  const char* when) {
  const int64_t calls = static_cast<int64_t>(records.size());
  const int64_t ep = records.front().group.size();
  at::Tensor host = all.to(at::kCPU).view({ep, calls, -1});
  refuse_uncounted(records, host, when);
  for (int64_t c = 0; c < calls; ++c) {
    at::Tensor over = host.select(1, c).narrow(1, 0, ep); // [source, destination]
    if (over.max().item<int64_t>() == 0) {
      continue;
    }
    const int64_t flat = over.flatten().argmax().item<int64_t>();
    const int64_t src = flat / ep, dst = flat % ep;
    const OverflowRecord& r = records[static_cast<size_t>(c)];
    const int64_t local = r.counts.size(0) / ep, rows = over[src][dst].item<int64_t>();
    at::Tensor per = host.select(1, c)[src].narrow(0, ep + dst * local, local);
    std::vector<int64_t> counts(per.data_ptr<int64_t>(), per.data_ptr<int64_t>() + local);
    DTENSOR_FAIL("ExpertParallel on {} (its experts call {} of the step): ep rank {} routed {} "
                 "rows to experts {}..{} of ep rank {} (rows per expert [{}]), {} over the "
                 "capacity of {} rows "
                 "(capacity_factor {} x max_rows {} / ep {}); refused {}, before any optimizer "
                 "step. Raise capacity_factor ({} never overflows), or choose EpOverflow::Drop "
                 "or EpDispatch::Variable",
                 r.layer, c + 1, src, r.capacity + rows, dst * local, (dst + 1) * local - 1, dst,
                 fmt::join(counts, ", "), rows, r.capacity, r.factor, r.max_rows, ep, when, ep);
  }
}

} // namespace

void record_overflow(OverflowRecord record) {
  if (torch::autograd::get_current_graph_task_id() != -1 || record.overflow.is_meta()) {
    return; // a recompute, or a simulated rank (no values)
  }
  Overflows& o = overflows();
  std::lock_guard<std::mutex> lock(o.mutex);
  o.records.push_back(std::move(record));
}

void check_overflow(const char* when) {
  std::vector<OverflowRecord> records;
  {
    Overflows& o = overflows();
    std::lock_guard<std::mutex> lock(o.mutex);
    records.swap(o.records);
  }
  // By group, in the order the groups first appear (the same on every rank of each).
  while (!records.empty()) {
    const Group group = records.front().group;
    std::vector<OverflowRecord> mine, rest;
    for (auto& r : records) {
      (r.group == group ? mine : rest).push_back(std::move(r));
    }
    records = std::move(rest);
    std::vector<at::Tensor> rows;
    for (const auto& r : mine) {
      rows.push_back(at::cat({r.overflow, r.counts, r.rows_and_counted}));
    }
    at::Tensor all = dtensor::all_gather_tensor(at::stack(rows), 0, group, detail::known_sizes());
    refuse_first(mine, all, when);
  }
}

void queue_overflow_check() {
  Overflows& o = overflows();
  std::lock_guard<std::mutex> lock(o.mutex);
  // After a failed backward its records stay and are checked with this one's: a refusal of
  // rows that went nowhere is the worst a stale record can cause.
  o.end_of_backward.queue([] {},
                          [] {
                            overflows().end_of_backward.ran();
                            check_overflow("at the end of the backward");
                          });
}

void add_device_rows(const at::Tensor& received, const at::Tensor& dropped) {
  if (received.is_meta()) {
    return; // a simulated rank: no values to count
  }
  Overflows& o = overflows();
  std::lock_guard<std::mutex> lock(o.mutex);
  if (!o.received.defined()) {
    o.received = at::zeros({}, received.options());
    o.dropped = at::zeros({}, dropped.options());
  }
  o.received.add_(received.detach());
  o.dropped.add_(dropped.detach());
}

std::pair<int64_t, int64_t> take_device_rows() {
  at::Tensor received, dropped;
  {
    Overflows& o = overflows();
    std::lock_guard<std::mutex> lock(o.mutex);
    std::swap(received, o.received);
    std::swap(dropped, o.dropped);
  }
  if (!received.defined()) {
    return {0, 0};
  }
  return {received.item<int64_t>(), dropped.item<int64_t>()};
}

} // namespace dtensor::detail::ep
