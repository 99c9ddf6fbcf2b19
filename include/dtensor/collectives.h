#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <dtensor/process_group.h>
#include <dtensor/reduce_op.h>

namespace c10d {
class Work;
} // namespace c10d

namespace dtensor {

// [Note: the collective choke point]
// Every collective dtensor issues (DTensor redistribution, FSDP all-gather and
// reduce-scatter, norm reductions, scalers, hooks) goes through the functions below. They
// check their arguments, report to every active CommDebugMode, then call the c10d backend.
// Nothing else in the library may call a c10d collective, which is what lets tests assert
// exact collective counts.
//
// The sizes a caller passes may differ between ranks by mistake. On Gloo groups of two or
// more ranks every function below except barrier, send and recv first agrees on them: one
// small all-gather of a fingerprint per call, not counted by CommDebugMode, after which a
// mismatch (other shapes, dtypes, reduce ops or split sizes, or another collective altogether)
// raises the same dtensor::Error on every rank, naming each rank's tensor, before any data
// moves ([Note: agreeing on sizes] in lib/mesh/size_check.cpp). Callers whose sizes agree by
// construction (the library's own: a DTensor's checked global shape, fully_shard's flat
// buffers, a bucket) skip it with CollectiveOptions::agree_sizes(false). Each collective has
// this one entry.

struct CollectiveOptions {
  // Return at once with a pending Work instead of waiting for completion. The tensors
  // must not be read or freed before Work::wait(). The functional forms (returning a tensor)
  // wait: they refuse it.
  TORCH_ARG(bool, async_op) = false;
  // Agree on the sizes first (above); false when every rank's sizes agree by construction.
  TORCH_ARG(bool, agree_sizes) = true;
};

// A pending collective. wait() blocks until it completes (or throws dtensor::Error naming
// the collective and group when it failed or timed out) and then runs the finishing step
// the collective needs (for example the division of an emulated average).
class Work {
 public:
  Work() = default;
  Work(c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish, std::string what);
  ~Work();
  Work(Work&&) noexcept;
  Work& operator=(Work&&) noexcept;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  void wait();
  bool completed() const { return done_; }
  // The communication has finished, so wait() would not block (waited or not); no wait.
  bool is_ready() const;

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_;
  std::string what_;
  bool done_ = true;
};

// In place: every rank's `tensor` becomes the reduction over the group.
// Avg is emulated (Sum then divide) where the backend lacks it; it needs a floating dtype.
Work all_reduce_(at::Tensor& tensor, ReduceOp op, const Group& group,
                 const CollectiveOptions& options = {});
// Functional form: returns the reduced tensor, leaves `tensor` alone.
at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op, const Group& group,
                      const CollectiveOptions& options = {});

// `output` (size(0) == group.size() * input.size(0), same trailing shape) receives every
// rank's `input`, stacked along dim 0 in group-rank order.
Work all_gather_into_tensor(at::Tensor& output, const at::Tensor& input, const Group& group,
                            const CollectiveOptions& options = {});
// Functional form: concatenates every rank's `input` along `gather_dim`.
at::Tensor all_gather_tensor(const at::Tensor& input, int64_t gather_dim, const Group& group,
                             const CollectiveOptions& options = {});

// `input` (size(0) == group.size() * output.size(0)) is reduced over the group and group
// rank r keeps slice r along dim 0 in `output`.
Work reduce_scatter_tensor_into(at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                const Group& group, const CollectiveOptions& options = {});
// Functional form: reduces, then keeps this rank's slice along `scatter_dim` (whose size
// must be divisible by the group size).
at::Tensor reduce_scatter_tensor(const at::Tensor& input, ReduceOp op, int64_t scatter_dim,
                                 const Group& group, const CollectiveOptions& options = {});

// Rank r sends rows input[in_splits[0..j-1] sum .. +in_splits[j]) to group rank j and
// receives out_splits[j] rows from it. Empty splits mean equal splits along dim 0.
at::Tensor all_to_all_single(const at::Tensor& input, const std::vector<int64_t>& out_splits,
                             const std::vector<int64_t>& in_splits, const Group& group,
                             const CollectiveOptions& options = {});

// In place: every rank's `tensor` becomes group rank `src`'s.
Work broadcast_(at::Tensor& tensor, int src, const Group& group,
                const CollectiveOptions& options = {});

void barrier(const Group& group);

// Point-to-point, between two ranks of `group` (group ranks): `tensor` goes to `dst`, or
// arrives from `src` into `tensor` (same shape and dtype as sent). `tag` tells apart
// transfers in flight between the same two ranks. With async_op the caller waits on the
// returned Work (a send's tensor must stay alive and unchanged until then).
Work send(const at::Tensor& tensor, int dst, const Group& group, int tag = 0,
          const CollectiveOptions& options = {});
Work recv(at::Tensor& tensor, int src, const Group& group, int tag = 0,
          const CollectiveOptions& options = {});

// Group rank 0 runs `body` (file-system work, say); every rank then raises the same
// dtensor::Error, "<what>: rank r: <message>", when it threw. One all-gather of one integer
// when it did not.
void on_rank0(const std::string& what, const std::function<void()>& body, const Group& group);
// The same with every rank running `body` (each rank's own files): every rank raises the
// same dtensor::Error naming each rank whose body threw.
void on_every_rank(const std::string& what, const std::function<void()>& body,
                   const Group& group);

} // namespace dtensor
