// The collective choke point (see [Note: the collective choke point] in collectives.h).
#include <dtensor/collectives.h>
#include <dtensor/comm_debug_mode.h>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "internal/check.h"
#include "mesh/collective_calls.h"
#include "mesh/collectives_internal.h"
#include "mesh/comm_debug.h"
#include "mesh/flight_recorder.h"
#include "mesh/process_group_state.h"

namespace dtensor {

namespace {

using detail::describe;

void check_group(const char* what, const Group& group) {
  DTENSOR_CHECK(group.defined(), "{}: undefined group (this rank is not a member of it)", what);
}

void check_tensor(const char* what, const char* name, const at::Tensor& t, const Group& group) {
  DTENSOR_CHECK(t.defined(), "{}: {} is an undefined tensor (group {})", what, name,
                group.to_string());
  // The simulated world's bookkeeping tensors (agreement) stay on the CPU.
  DTENSOR_CHECK(t.device().type() == group.device_type() ||
                    (group.backend_type() == BackendType::Fake && t.is_cpu()),
                "{}: {} is {} but group {} moves {} tensors", what, name, describe(t),
                group.to_string(), c10::DeviceTypeName(group.device_type(), true));
  DTENSOR_CHECK(t.is_contiguous(), "{}: {} ({}) must be contiguous", what, name, describe(t));
  DTENSOR_CHECK(!t.is_sparse(), "{}: {} ({}) is sparse; only dense tensors are supported", what,
                name, describe(t));
}

// [Note: complex tensors on the wire]
// Gloo has no complex types, so a complex tensor travels as its real view (a trailing dim
// of 2: real and imaginary parts), which sums, averages, gathers, scatters and broadcasts
// exactly like the complex numbers. Max / min / product have no meaning on it: refused.
at::Tensor wire(const at::Tensor& t) {
  return t.is_complex() ? at::view_as_real(t) : t;
}

void check_complex_op(const char* what, ReduceOp op, const at::Tensor& t) {
  DTENSOR_CHECK(!t.is_complex() || op == ReduceOp::Sum || op == ReduceOp::Avg,
                "{}: ReduceOp {} is not defined for the complex tensor {}", what, to_string(op),
                describe(t));
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
  case ReduceOp::Sum:
    return c10d::ReduceOp(c10d::ReduceOp::SUM);
  case ReduceOp::Avg:
    return c10d::ReduceOp(c10d::ReduceOp::AVG);
  case ReduceOp::Max:
    return c10d::ReduceOp(c10d::ReduceOp::MAX);
  case ReduceOp::Min:
    return c10d::ReduceOp(c10d::ReduceOp::MIN);
  case ReduceOp::Product:
    return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
  }
  DTENSOR_FAIL("unknown ReduceOp {}", static_cast<int>(op));
}

// [Note: emulated average]
// Gloo has no AVG. We reduce with SUM and divide the result by the group size when the
// collective completes, so callers (and CommDebugMode) still see a single collective.
bool emulate_avg(ReduceOp op, const Group& group) {
  return op == ReduceOp::Avg && group.backend_type() != BackendType::Nccl;
}

c10d::ReduceOp backend_op(const char* what, ReduceOp op, const at::Tensor& t, const Group& group) {
  if (op == ReduceOp::Avg) {
    DTENSOR_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()),
                  "{}: ReduceOp avg needs a floating-point tensor, got {}", what, describe(t));
  }
  return emulate_avg(op, group) ? c10d::ReduceOp(c10d::ReduceOp::SUM) : to_c10d(op);
}

void report(CollectiveKind kind, const Group& group, ReduceOp op, const at::Tensor& in,
            int64_t bytes_out, bool async) {
  if (!detail::comm_debug_active() || detail::Uncounted::active()) {
    return;
  }
  CollectiveRecord rec;
  rec.kind = kind;
  rec.group = group.label();
  rec.ranks = group.ranks();
  rec.op = op;
  if (in.defined()) {
    rec.dtype = in.scalar_type();
    rec.shape = in.sizes().vec();
    rec.bytes_in = static_cast<int64_t>(in.nbytes());
  }
  rec.bytes_out = bytes_out;
  rec.async = async;
  detail::record_collective(rec);
}

template <typename Issue>
Work run(const std::string& what, const Group& group, const CollectiveOptions& options,
         Issue&& issue, std::function<void()> finish = {}) {
  const int64_t id = detail::flight_issued(what, group);
  // [Note: waits on the timeline]: the records report() just made, stamped at the wait.
  std::vector<detail::RecordMark> marks = detail::take_record_marks();
  if (!options.async_op()) {
    marks.clear();
  }
  // Named in profiler traces ("dtensor::all_reduce", over the wait of a blocking call); the
  // name is built only while a profiler records. It outlives the scope that refers to it.
  std::string scope_name;
  at::RecordFunction scope(at::RecordScope::USER_SCOPE);
  if (scope.isActive()) {
    scope_name = "dtensor::" + what.substr(0, what.find('('));
    scope.before(scope_name, c10::ArrayRef<const c10::IValue>{});
  }
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = issue(*group.backend());
  } catch (const Error& e) {
    detail::flight_failed(id, e.what());
    throw;
  } catch (const c10::Error& e) {
    const std::string message = fmt::format("{} on group {} failed: {}", what, group.to_string(),
                                            e.what_without_backtrace());
    detail::flight_failed(id, message);
    DTENSOR_FAIL("{}", message);
  } catch (const std::exception& e) {
    const std::string message =
        fmt::format("{} on group {} failed: {}", what, group.to_string(), e.what());
    detail::flight_failed(id, message);
    DTENSOR_FAIL("{}", message);
  }
  // Completion is recorded when the Work is waited on (a failure: in Work::wait).
  auto done = [id, finish = std::move(finish), marks = std::move(marks)] {
    detail::record_wait(marks);
    detail::flight_completed(id);
    if (finish) {
      finish();
    }
  };
  Work handle(std::move(work), std::move(done), what + " on group " + group.to_string());
  if (!options.async_op()) {
    handle.wait();
  }
  return handle;
}

int64_t normalize_dim(const char* what, int64_t dim, const at::Tensor& t) {
  int64_t nd = t.dim();
  DTENSOR_CHECK(nd > 0, "{}: needs a tensor with at least one dimension, got {}", what,
                describe(t));
  DTENSOR_CHECK(dim >= -nd && dim < nd, "{}: dim {} is out of range for {}", what, dim,
                describe(t));
  return dim < 0 ? dim + nd : dim;
}

} // namespace

namespace detail {

std::string describe(const at::Tensor& t) {
  return t.defined() ? fmt::format("{}{} on {}", c10::toString(t.scalar_type()), t.sizes(),
                                   t.device().str())
                     : std::string("an undefined tensor");
}

namespace {
thread_local int uncounted_depth = 0;
} // namespace

Uncounted::Uncounted() {
  ++uncounted_depth;
}
Uncounted::~Uncounted() {
  --uncounted_depth;
}
bool Uncounted::active() {
  return uncounted_depth > 0;
}

} // namespace detail

std::string to_string(ReduceOp op) {
  switch (op) {
  case ReduceOp::Sum:
    return "sum";
  case ReduceOp::Avg:
    return "avg";
  case ReduceOp::Max:
    return "max";
  case ReduceOp::Min:
    return "min";
  case ReduceOp::Product:
    return "product";
  }
  return "?";
}

std::string to_string(CollectiveKind kind) {
  switch (kind) {
  case CollectiveKind::AllReduce:
    return "all_reduce";
  case CollectiveKind::AllGather:
    return "all_gather";
  case CollectiveKind::ReduceScatter:
    return "reduce_scatter";
  case CollectiveKind::AllToAll:
    return "all_to_all";
  case CollectiveKind::Broadcast:
    return "broadcast";
  case CollectiveKind::Barrier:
    return "barrier";
  case CollectiveKind::Send:
    return "send";
  case CollectiveKind::Recv:
    return "recv";
  }
  return "?";
}

Work::Work(c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish, std::string what)
    : work_(std::move(work)), finish_(std::move(finish)), what_(std::move(what)), done_(false) {}

Work::Work(Work&& other) noexcept
    : work_(std::move(other.work_)), finish_(std::move(other.finish_)),
      what_(std::move(other.what_)), done_(other.done_) {
  other.done_ = true;
}

Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    work_ = std::move(other.work_);
    finish_ = std::move(other.finish_);
    what_ = std::move(other.what_);
    done_ = other.done_;
    other.done_ = true;
  }
  return *this;
}

Work::~Work() {
  // A dropped async Work still completes before its tensors can be reused.
  if (!done_) {
    try {
      wait();
    } catch (const std::exception& e) {
      fmt::print(stderr, "dtensor: pending {} failed while its Work was dropped: {}\n", what_,
                 e.what());
    }
  }
}

bool Work::is_ready() const {
  return done_ || !work_ || work_->isCompleted();
}

void Work::wait() {
  if (done_) {
    return;
  }
  done_ = true;
  try {
    if (work_) {
      work_->wait();
    }
  } catch (const c10::Error& e) {
    const std::string message = fmt::format("{} failed: {}", what_, e.what_without_backtrace());
    detail::flight_failure(message);
    DTENSOR_FAIL("{}", message);
  } catch (const std::exception& e) {
    const std::string message = fmt::format("{} failed: {}", what_, e.what());
    detail::flight_failure(message);
    DTENSOR_FAIL("{}", message);
  }
  if (finish_) {
    finish_();
  }
}

namespace detail {

// The collectives themselves, without agreeing on sizes first (collective_calls.h): the
// public entries of dtensor/collectives.h agree when asked, then call these (size_check.cpp).

Work unagreed::all_reduce_(at::Tensor& tensor, ReduceOp op, const Group& group,
                           const CollectiveOptions& options) {
  const char* what = "all_reduce";
  check_group(what, group);
  check_tensor(what, "tensor", tensor, group);
  c10d::AllreduceOptions opts;
  check_complex_op(what, op, tensor);
  opts.reduceOp = backend_op(what, op, tensor, group);
  report(CollectiveKind::AllReduce, group, op, tensor, static_cast<int64_t>(tensor.nbytes()),
         options.async_op());
  std::function<void()> finish;
  if (emulate_avg(op, group)) {
    finish = [tensor, n = group.size()]() mutable { tensor.div_(n); };
  }
  std::vector<at::Tensor> tensors{wire(tensor)};
  return run(
      fmt::format("all_reduce({}, {})", to_string(op), describe(tensor)), group, options,
      [&](c10d::Backend& b) { return b.allreduce(tensors, opts); }, std::move(finish));
}

at::Tensor unagreed::all_reduce(const at::Tensor& tensor, ReduceOp op, const Group& group) {
  at::Tensor out = tensor.clone(at::MemoryFormat::Contiguous);
  unagreed::all_reduce_(out, op, group);
  return out;
}

Work unagreed::all_gather_into_tensor(at::Tensor& output, const at::Tensor& input,
                                      const Group& group, const CollectiveOptions& options) {
  const char* what = "all_gather_into_tensor";
  check_group(what, group);
  check_tensor(what, "input", input, group);
  check_tensor(what, "output", output, group);
  DTENSOR_CHECK(input.dim() > 0 && output.dim() == input.dim() &&
                    output.size(0) == input.size(0) * group.size() &&
                    output.sizes().slice(1) == input.sizes().slice(1) &&
                    output.scalar_type() == input.scalar_type(),
                "{}: output {} does not fit input {} gathered over {} ranks of group {} "
                "(expected dim 0 = {} x {})",
                what, describe(output), describe(input), group.size(), group.to_string(),
                group.size(), input.dim() > 0 ? input.size(0) : 0);
  report(CollectiveKind::AllGather, group, ReduceOp::Sum, input,
         static_cast<int64_t>(output.nbytes()), options.async_op());
  at::Tensor in = wire(input);
  at::Tensor out = wire(output);
  std::string name = fmt::format("all_gather_into_tensor({})", describe(input));
  return run(std::move(name), group, options, [&](c10d::Backend& b) {
    return b._allgather_base(out, in, c10d::AllgatherOptions());
  });
}

Work all_gather_into_pieces(std::vector<std::vector<at::Tensor>>& outputs,
                            std::vector<at::Tensor>& inputs, const Group& group,
                            const CollectiveOptions& options) {
  const char* what = "all_gather_into_pieces";
  check_group(what, group);
  DTENSOR_CHECK(group.backend_type() == BackendType::Gloo, "{}: only on Gloo groups, got group {}",
                what, group.to_string());
  DTENSOR_CHECK(!inputs.empty() && outputs.size() == static_cast<size_t>(group.size()),
                "{}: {} input pieces and {} output lists for the {} ranks of group {}", what,
                inputs.size(), outputs.size(), group.size(), group.to_string());
  int64_t numel = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(what, "input piece", inputs[i], group);
    DTENSOR_CHECK(!inputs[i].is_complex() && inputs[i].scalar_type() == inputs[0].scalar_type(),
                  "{}: piece {} is {}; pieces must share one real dtype", what, i,
                  describe(inputs[i]));
    numel += inputs[i].numel();
  }
  for (const auto& list : outputs) {
    DTENSOR_CHECK(list.size() == inputs.size(), "{}: an output list has {} pieces, not {}", what,
                  list.size(), inputs.size());
    for (size_t i = 0; i < list.size(); ++i) {
      DTENSOR_CHECK(list[i].sizes() == inputs[i].sizes() &&
                        list[i].scalar_type() == inputs[i].scalar_type() &&
                        list[i].device() == inputs[i].device(),
                    "{}: output piece {} ({}) does not match input piece {} ({})", what, i,
                    describe(list[i]), i, describe(inputs[i]));
    }
  }
  const at::Tensor first = inputs[0];
  if (detail::comm_debug_active() && !detail::Uncounted::active()) {
    CollectiveRecord rec;
    rec.kind = CollectiveKind::AllGather;
    rec.group = group.label();
    rec.ranks = group.ranks();
    rec.dtype = first.scalar_type();
    rec.shape = {numel};
    rec.bytes_in = numel * static_cast<int64_t>(first.element_size());
    rec.bytes_out = rec.bytes_in * group.size();
    rec.async = options.async_op();
    detail::record_collective(rec);
  }
  return run(fmt::format("{}({} pieces, {} elements of {})", what, inputs.size(), numel,
                         c10::toString(first.scalar_type())),
             group, options, [&](c10d::Backend& b) {
               return b.allgather_coalesced(outputs, inputs, c10d::AllgatherOptions());
             });
}

bool reduce_scatter_input_free_at_issue(const Group& group, ReduceOp op) {
  // [Note: reduce-scatter input released at issue]
  // ProcessGroupGloo clones the input at issue; its decorator's all-to-all path (SUM, and so
  // an emulated average) reads it until done ([Note: Gloo's reduce-scatter as an all-to-all]
  // in gloo_fast_paths.cpp).
  const bool by_all_to_all =
      detail::has_gloo_fast_paths(*group.backend()) && (op == ReduceOp::Sum || op == ReduceOp::Avg);
  return group.backend_type() == BackendType::Gloo && !by_all_to_all;
}

at::Tensor unagreed::all_gather_tensor(const at::Tensor& input, int64_t gather_dim,
                                       const Group& group) {
  const char* what = "all_gather_tensor";
  check_group(what, group);
  int64_t dim = normalize_dim(what, gather_dim, input);
  at::Tensor in = input.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] *= group.size();
  at::Tensor out = at::empty(shape, in.options());
  unagreed::all_gather_into_tensor(out, in, group);
  if (dim == 0) {
    return out;
  }
  return at::cat(out.chunk(group.size(), 0), dim);
}

Work unagreed::reduce_scatter_tensor_into(at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                          const Group& group, const CollectiveOptions& options) {
  const char* what = "reduce_scatter_tensor";
  check_group(what, group);
  check_tensor(what, "input", input, group);
  check_tensor(what, "output", output, group);
  DTENSOR_CHECK(input.dim() > 0 && output.dim() == input.dim() &&
                    input.size(0) == output.size(0) * group.size() &&
                    output.sizes().slice(1) == input.sizes().slice(1) &&
                    output.scalar_type() == input.scalar_type(),
                "{}: input {} does not split into output {} over {} ranks of group {} "
                "(expected input dim 0 = {} x output dim 0)",
                what, describe(input), describe(output), group.size(), group.to_string(),
                group.size());
  c10d::ReduceScatterOptions opts;
  check_complex_op(what, op, input);
  opts.reduceOp = backend_op(what, op, input, group);
  report(CollectiveKind::ReduceScatter, group, op, input, static_cast<int64_t>(output.nbytes()),
         options.async_op());
  std::function<void()> finish;
  if (emulate_avg(op, group)) {
    finish = [output, n = group.size()]() mutable { output.div_(n); };
  }
  at::Tensor in = wire(input);
  at::Tensor out = wire(output);
  std::string name = fmt::format("reduce_scatter_tensor({}, {})", to_string(op), describe(input));
  return run(
      std::move(name), group, options,
      [&](c10d::Backend& b) { return b._reduce_scatter_base(out, in, opts); }, std::move(finish));
}

at::Tensor unagreed::reduce_scatter_tensor(const at::Tensor& input, ReduceOp op,
                                           int64_t scatter_dim, const Group& group) {
  const char* what = "reduce_scatter_tensor";
  check_group(what, group);
  int64_t dim = normalize_dim(what, scatter_dim, input);
  int64_t n = group.size();
  DTENSOR_CHECK(input.size(dim) % n == 0,
                "{}: dim {} of {} (size {}) is not divisible by the {} ranks of group {}", what,
                dim, describe(input), input.size(dim), n, group.to_string());
  at::Tensor in = dim == 0 ? input.contiguous() : at::cat(input.chunk(n, dim), 0).contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] /= n;
  at::Tensor out = at::empty(shape, in.options());
  // Chunks along `dim` were stacked along dim 0, so this rank's slice already has the
  // result's shape.
  unagreed::reduce_scatter_tensor_into(out, in, op, group);
  return out;
}

namespace {

// The rows an all-to-all receives: the sum of out_splits, or as many as it sends.
int64_t all_to_all_rows(const char* what, const at::Tensor& in,
                        const std::vector<int64_t>& out_splits,
                        const std::vector<int64_t>& in_splits, const Group& group) {
  int64_t n = group.size();
  DTENSOR_CHECK(in.dim() > 0, "{}: needs at least one dimension, got {}", what, describe(in));
  auto check_splits = [&](const std::vector<int64_t>& splits, const char* name) {
    DTENSOR_CHECK(splits.empty() || static_cast<int64_t>(splits.size()) == n,
                  "{}: {} {} must have one entry per rank of group {}", what, name, splits,
                  group.to_string());
    for (int64_t s : splits) {
      DTENSOR_CHECK(s >= 0, "{}: negative split in {} {}", what, name, splits);
    }
  };
  check_splits(out_splits, "out_splits");
  check_splits(in_splits, "in_splits");
  if (in_splits.empty()) {
    DTENSOR_CHECK(in.size(0) % n == 0,
                  "{}: dim 0 of {} is not divisible by the {} ranks of group {}", what,
                  describe(in), n, group.to_string());
  } else {
    int64_t total = 0;
    for (int64_t s : in_splits) {
      total += s;
    }
    DTENSOR_CHECK(total == in.size(0), "{}: in_splits {} add up to {}, but input is {}", what,
                  in_splits, total, describe(in));
  }
  if (out_splits.empty()) {
    return in.size(0);
  }
  int64_t rows = 0;
  for (int64_t s : out_splits) {
    rows += s;
  }
  return rows;
}

} // namespace

Work all_to_all_single_into(at::Tensor& output, const at::Tensor& input,
                            const std::vector<int64_t>& out_splits,
                            const std::vector<int64_t>& in_splits, const Group& group,
                            const CollectiveOptions& options) {
  const char* what = "all_to_all_single";
  check_group(what, group);
  check_tensor(what, "input", input, group);
  check_tensor(what, "output", output, group);
  const int64_t rows = all_to_all_rows(what, input, out_splits, in_splits, group);
  DTENSOR_CHECK(output.dim() == input.dim() && output.size(0) == rows &&
                    output.sizes().slice(1) == input.sizes().slice(1) &&
                    output.scalar_type() == input.scalar_type(),
                "{}: output {} does not fit the {} rows of {} it receives", what, describe(output),
                rows, describe(input));
  report(CollectiveKind::AllToAll, group, ReduceOp::Sum, input,
         static_cast<int64_t>(output.nbytes()), options.async_op());
  std::vector<int64_t> os = out_splits;
  std::vector<int64_t> is = in_splits;
  at::Tensor win = wire(input);
  at::Tensor wout = wire(output);
  return run(fmt::format("all_to_all_single({})", describe(input)), group, options,
             [&](c10d::Backend& b) {
               return b.alltoall_base(wout, win, os, is, c10d::AllToAllOptions());
             });
}

at::Tensor unagreed::all_to_all_single(const at::Tensor& input,
                                       const std::vector<int64_t>& out_splits,
                                       const std::vector<int64_t>& in_splits, const Group& group) {
  const char* what = "all_to_all_single";
  check_group(what, group);
  at::Tensor in = input.contiguous();
  check_tensor(what, "input", in, group);
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = all_to_all_rows(what, in, out_splits, in_splits, group);
  at::Tensor out = at::empty(shape, in.options());
  all_to_all_single_into(out, in, out_splits, in_splits, group);
  return out;
}

Work unagreed::broadcast_(at::Tensor& tensor, int src, const Group& group,
                          const CollectiveOptions& options) {
  const char* what = "broadcast";
  check_group(what, group);
  check_tensor(what, "tensor", tensor, group);
  DTENSOR_CHECK(src >= 0 && src < group.size(),
                "{}: source group rank {} is out of range for group {}", what, src,
                group.to_string());
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  opts.rootTensor = 0;
  report(CollectiveKind::Broadcast, group, ReduceOp::Sum, tensor,
         static_cast<int64_t>(tensor.nbytes()), options.async_op());
  std::vector<at::Tensor> tensors{wire(tensor)};
  return run(fmt::format("broadcast(src={}, {})", src, describe(tensor)), group, options,
             [&](c10d::Backend& b) { return b.broadcast(tensors, opts); });
}

} // namespace detail

namespace {

void check_peer(const char* what, int peer, const Group& group) {
  DTENSOR_CHECK(peer >= 0 && peer < group.size() && peer != group.rank(),
                "{}: peer group rank {} is not another rank of group {} (this rank is {})", what,
                peer, group.to_string(), group.rank());
}

} // namespace

Work send(const at::Tensor& tensor, int dst, const Group& group, int tag,
          const CollectiveOptions& options) {
  const char* what = "send";
  check_group(what, group);
  check_tensor(what, "tensor", tensor, group);
  check_peer(what, dst, group);
  report(CollectiveKind::Send, group, ReduceOp::Sum, tensor, 0, options.async_op());
  std::vector<at::Tensor> tensors{wire(tensor.contiguous())};
  return run(fmt::format("send({} to group rank {}, tag {})", describe(tensor), dst, tag), group,
             options, [&](c10d::Backend& b) { return b.send(tensors, dst, tag); });
}

Work recv(at::Tensor& tensor, int src, const Group& group, int tag,
          const CollectiveOptions& options) {
  const char* what = "recv";
  check_group(what, group);
  check_tensor(what, "tensor", tensor, group);
  check_peer(what, src, group);
  DTENSOR_CHECK(tensor.is_contiguous(), "recv: the receiving tensor must be contiguous, got {}",
                describe(tensor));
  report(CollectiveKind::Recv, group, ReduceOp::Sum, at::Tensor(),
         static_cast<int64_t>(tensor.nbytes()), options.async_op());
  std::vector<at::Tensor> tensors{wire(tensor)};
  return run(fmt::format("recv({} from group rank {}, tag {})", describe(tensor), src, tag), group,
             options, [&](c10d::Backend& b) { return b.recv(tensors, src, tag); });
}

void barrier(const Group& group) {
  check_group("barrier", group);
  report(CollectiveKind::Barrier, group, ReduceOp::Sum, at::Tensor(), 0, false);
  run("barrier", group, CollectiveOptions(),
      [&](c10d::Backend& b) { return b.barrier(c10d::BarrierOptions()); });
}

} // namespace dtensor
