// A c10d::Backend decorating ProcessGroupGloo with faster paths for two of its collectives,
// built as c10d's ProcessGroupWrapper is: every other call goes to the wrapped backend. The
// collective choke point (collectives.cpp) stays generic: it calls the c10d::Backend API and
// never asks which backend it talks to.
#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "mesh/process_group_state.h"

namespace dtensor::detail {

namespace {

// [Note: Gloo's reduce-scatter as an all-to-all]
// ProcessGroupGloo's reduce_scatter_tensor clones its input and all-reduces the clone: every
// rank sends 2 (n - 1) / n of the input over the wire and then keeps 1 / n of the result. An
// all-to-all sends each rank's chunk r straight to rank r ((n - 1) / n of the input) and the
// sum of the n chunks received is the rank's shard: half the traffic and no clone, which on
// loopback TCP measured 1.5-2.4x faster (2 and 4 ranks, 3 and 12 MiB; bench/reduce_scatter,
// docs/benchmarks.md).
// The all-to-all is made of point-to-point transfers (ProcessGroupGloo's send / recv read and
// write the callers' memory), all posted at issue, so that nothing is received that is not
// needed: each chunk goes from the input itself, this rank's own chunk never moves, and the
// first peer's chunk lands in the output. Only the other n - 2 peers' chunks need a buffer
// (gloo::alltoall would receive the whole input's size). The tags are the all-gather's
// scheme ([Note: Gloo's all-gather by point-to-point]) over a range of their own.
// The sum runs when the collective is waited on: the chunks one add at a time in rank order,
// so every rank adds in the same order (and the result is a function of the inputs alone);
// each add rounds to the tensor's dtype, as NCCL's ring and Gloo's own sums do.
// SUM only (an average is a SUM divided afterwards by the choke point, [Note: emulated
// average] in collectives.cpp); other ops keep Gloo's reduce-scatter.
// CommDebugMode still records one reduce-scatter (the choke point records what it asked for).
// Gloo reads the input until the sends complete: the Work holds it until then.
// Two ranks exchange only the peer's chunk ([Note: two Gloo ranks by split sizes]).
// Under TORCH_DISTRIBUTED_DEBUG=DETAIL no group is decorated: c10d's wrapper compares every
// rank's shapes before a reduce-scatter or an all-gather, never before an all-to-all (uneven
// splits are legal there), and a size mismatch inside Gloo aborts the process ([Note:
// TORCH_DISTRIBUTED_DEBUG=DETAIL] in lib/mesh/backend_gloo.cpp).
//
// [Note: two Gloo ranks by split sizes]
// On a Gloo group of two ranks an all-to-all with split sizes (0 rows to oneself) moves just
// what crosses to the peer, straight between the callers' tensors (gloo::alltoallv sends
// from and receives into the pointers it is given):
//  - all-gather: this rank's rows are copied into their place in the output and the peer's
//    rows arrive in theirs. ProcessGroupGloo's allgather receives into a flat temporary of
//    the whole output and copies it out: one output's size of memory while in flight (a
//    prefetch, [Note: overlap] in lib/parallel/fsdp/fsdp_state.cpp) and a copy, both gone.
//  - reduce-scatter: the peer's chunk is sent and the peer's half of this rank's shard is
//    received into the output itself; the finish adds this rank's half to it (the sum of the
//    rank order: a + b == b + a in floating point).
// Wire bytes and CommDebugMode's records are those of the collective named.
//
// [Note: Gloo's all-gather by point-to-point]
// Over more ranks ProcessGroupGloo's allgather still receives into a flat temporary of the
// whole output and copies it out: while a prefetched all-gather is in flight, one more
// output's size is alive (the MoE benchmark's peak held one). Here each rank sends its rows
// to every peer and receives each peer's rows straight into their place in the output
// (ProcessGroupGloo's send / recv read and write the callers' memory): the same bytes on the
// wire ((n - 1) x the input, as the ring), no temporary, no copy, all transfers posted at
// once. Point-to-point messages match by (peer, tag), so every all-gather of the group takes
// the next tag of its own range ([kAllGatherTag, + 0x10000), a counter per group: collectives
// are issued in the same order on every rank of a group); dtensor's other point-to-point
// tags (the ring's, the pipeline's) lie outside it.

constexpr int kAllGatherTag = 0x61670000;
constexpr int kReduceScatterTag = 0x72730000; // [Note: Gloo's reduce-scatter as an all-to-all]

// Several transfers as one Work: done when every one is.
class AllOfWork : public c10d::Work {
 public:
  AllOfWork(std::vector<c10::intrusive_ptr<c10d::Work>> works, c10d::OpType type)
      : c10d::Work(-1, type), works_(std::move(works)) {}
  bool isCompleted() override {
    for (auto& w : works_) {
      if (!w->isCompleted()) {
        return false;
      }
    }
    return true;
  }
  bool isSuccess() const override {
    for (const auto& w : works_) {
      if (!w->isSuccess()) {
        return false;
      }
    }
    return true;
  }
  std::exception_ptr exception() const override {
    for (const auto& w : works_) {
      if (std::exception_ptr e = w->exception()) {
        return e;
      }
    }
    return nullptr;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    bool done = true;
    for (auto& w : works_) {
      done = w->wait(timeout) && done;
    }
    return done;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

// A collective whose result needs a last local step once the transfer is done: `finish` runs
// once, in the first wait(), after the wrapped Work's.
class FinishingWork : public c10d::Work {
 public:
  FinishingWork(c10::intrusive_ptr<c10d::Work> inner, std::function<void()> finish,
                c10d::OpType type)
      : c10d::Work(-1, type), inner_(std::move(inner)), finish_(std::move(finish)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  bool wait(std::chrono::milliseconds timeout) override {
    const bool done = inner_->wait(timeout);
    std::call_once(once_, [this] {
      finish_();
      finish_ = nullptr; // the buffers it holds go now
    });
    return done;
  }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::function<void()> finish_;
  std::once_flag once_;
};

class GlooFastPaths : public c10d::Backend {
 public:
  explicit GlooFastPaths(c10::intrusive_ptr<c10d::Backend> gloo)
      : c10d::Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)) {}

  const std::string getBackendName() const override { return gloo_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts) override {
    if (in.numel() == 0) {
      return gloo_->_allgather_base(out, in, opts);
    }
    if (size_ > 2) { // Gloo's point-to-point moves CPU memory
      return in.is_cpu() && out.is_cpu() ? all_gather_point_to_point(out, in)
                                         : gloo_->_allgather_base(out, in, opts);
    }
    const int64_t rows = in.size(0);
    out.narrow(0, rank_ * rows, rows).copy_(in);
    at::Tensor receive = out.narrow(0, (1 - rank_) * rows, rows);
    return exchange_with_peer(receive, in);
  }

  c10::intrusive_ptr<c10d::Work>
  _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                       const c10d::ReduceScatterOptions& opts) override {
    if (opts.reduceOp != c10d::ReduceOp::SUM) {
      return gloo_->_reduce_scatter_base(out, in, opts);
    }
    if (in.numel() == 0 || !in.is_cpu() || !out.is_cpu() || !in.is_contiguous() ||
        !out.is_contiguous()) { // Gloo's point-to-point moves contiguous CPU memory
      return reduce_scatter_by_all_to_all(out, in);
    }
    return size_ == 2 ? reduce_scatter_with_peer(out, in) : reduce_scatter_point_to_point(out, in);
  }

  // The rest as the wrapped backend does it.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return gloo_->broadcast(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    return gloo_->allreduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work>
  allreduce_coalesced(std::vector<at::Tensor>& tensors,
                      const c10d::AllreduceCoalescedOptions& opts) override {
    return gloo_->allreduce_coalesced(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    return gloo_->reduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return gloo_->allgather(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    return gloo_->allgather_coalesced(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work>
  allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                  const c10d::AllgatherOptions& opts) override {
    return gloo_->allgather_into_tensor_coalesced(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    return gloo_->gather(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return gloo_->scatter(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    return gloo_->reduce_scatter(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work>
  reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                  const c10d::ReduceScatterOptions& opts) override {
    return gloo_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override {
    return gloo_->alltoall_base(out, in, out_splits, in_splits, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return gloo_->alltoall(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return gloo_->send(tensors, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return gloo_->recv(tensors, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return gloo_->recvAnysource(tensors, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return gloo_->barrier(opts);
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    gloo_->monitoredBarrier(opts, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { gloo_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return gloo_->getSequenceNumberForGroup(); }
  void setTimeout(std::chrono::milliseconds timeout) override { gloo_->setTimeout(timeout); }

 private:
  // (two ranks) Sends `send` to the peer and receives the peer's rows into `receive`.
  c10::intrusive_ptr<c10d::Work> exchange_with_peer(at::Tensor& receive, at::Tensor& send) {
    const int peer = 1 - rank_;
    std::vector<int64_t> out_splits(2, 0);
    std::vector<int64_t> in_splits(2, 0);
    out_splits[static_cast<size_t>(peer)] = receive.size(0);
    in_splits[static_cast<size_t>(peer)] = send.size(0);
    return gloo_->alltoall_base(receive, send, out_splits, in_splits, c10d::AllToAllOptions());
  }

  // [Note: Gloo's all-gather by point-to-point]
  c10::intrusive_ptr<c10d::Work> all_gather_point_to_point(at::Tensor& out, at::Tensor& in) {
    const int64_t rows = in.size(0);
    const int tag = kAllGatherTag + static_cast<int>(all_gathers_++ % 0x10000);
    out.narrow(0, rank_ * rows, rows).copy_(in);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int step = 1; step < size_; ++step) { // each rank starts with its next peer
      const int to = (rank_ + step) % size_, from = (rank_ - step + size_) % size_;
      std::vector<at::Tensor> receive{out.narrow(0, from * rows, rows)};
      works.push_back(gloo_->recv(receive, from, tag));
      std::vector<at::Tensor> send{in};
      works.push_back(gloo_->send(send, to, tag));
    }
    return c10::make_intrusive<AllOfWork>(std::move(works), c10d::OpType::_ALLGATHER_BASE);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_with_peer(const at::Tensor& out,
                                                          const at::Tensor& in) {
    const int64_t me = rank_;
    const int64_t rows = out.size(0);
    at::Tensor send = in.narrow(0, (1 - me) * rows, rows);
    at::Tensor received = out; // the peer's half arrives in the output
    auto work = exchange_with_peer(received, send);
    auto finish = [shard = out, mine = in.narrow(0, me * rows, rows)]() mutable {
      at::add_out(shard, shard, mine);
    };
    return c10::make_intrusive<FinishingWork>(std::move(work), std::move(finish),
                                              c10d::OpType::_REDUCE_SCATTER_BASE);
  }

  // [Note: Gloo's reduce-scatter as an all-to-all]
  c10::intrusive_ptr<c10d::Work> reduce_scatter_point_to_point(const at::Tensor& out,
                                                               const at::Tensor& in) {
    const int n = size_, me = rank_;
    const int tag = kReduceScatterTag + static_cast<int>(reduce_scatters_++ % 0x10000);
    at::Tensor flat = out.view({-1});
    std::vector<at::Tensor> chunks = in.view({n, -1}).unbind(0);
    const int first = me == 0 ? 1 : 0; // the first peer in rank order: into the output
    at::Tensor buffers = at::empty({n - 2, flat.numel()}, flat.options());
    std::vector<at::Tensor> received(static_cast<size_t>(n));
    received[static_cast<size_t>(me)] = chunks[static_cast<size_t>(me)];
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    int64_t slot = 0;
    for (int step = 1; step < n; ++step) { // each rank starts with its next peer
      const int to = (me + step) % n, from = (me - step + n) % n;
      std::vector<at::Tensor> send{chunks[static_cast<size_t>(to)]};
      works.push_back(gloo_->send(send, to, tag));
      at::Tensor into = from == first ? flat : buffers[slot++];
      received[static_cast<size_t>(from)] = into;
      std::vector<at::Tensor> receive{into};
      works.push_back(gloo_->recv(receive, from, tag));
    }
    auto all = c10::make_intrusive<AllOfWork>(std::move(works), c10d::OpType::_REDUCE_SCATTER_BASE);
    auto finish = [flat, received = std::move(received), first]() mutable {
      // flat holds chunk `first`; the rest are added one at a time in rank order
      if (first == 1) {
        at::add_out(flat, received[0], flat);
      }
      for (size_t r = static_cast<size_t>(first) + 1; r < received.size(); ++r) {
        at::add_out(flat, flat, received[r]);
      }
    };
    return c10::make_intrusive<FinishingWork>(std::move(all), std::move(finish),
                                              c10d::OpType::_REDUCE_SCATTER_BASE);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_by_all_to_all(const at::Tensor& out,
                                                              const at::Tensor& in) {
    const int64_t n = size_;
    at::Tensor received = at::empty_like(in);
    at::Tensor input = in;
    std::vector<int64_t> even; // empty split sizes: n equal chunks of dim 0
    auto work = gloo_->alltoall_base(received, input, even, even, c10d::AllToAllOptions());
    auto finish = [out, received, input, n]() mutable {
      at::Tensor flat = out.view({-1});
      at::sum_out(flat, received.view({n, -1}), {0}, false, flat.scalar_type());
    };
    return c10::make_intrusive<FinishingWork>(std::move(work), std::move(finish),
                                              c10d::OpType::_REDUCE_SCATTER_BASE);
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::atomic<uint64_t> all_gathers_{0}; // [Note: Gloo's all-gather by point-to-point]
  std::atomic<uint64_t> reduce_scatters_{0}; // [Note: Gloo's reduce-scatter as an all-to-all]
};

} // namespace

c10::intrusive_ptr<c10d::Backend> with_gloo_fast_paths(c10::intrusive_ptr<c10d::Backend> gloo) {
  if (gloo->getSize() < 2) {
    return gloo;
  }
  return c10::make_intrusive<GlooFastPaths>(std::move(gloo));
}

bool has_gloo_fast_paths(const c10d::Backend& backend) {
  return dynamic_cast<const GlooFastPaths*>(&backend) != nullptr;
}

} // namespace dtensor::detail
