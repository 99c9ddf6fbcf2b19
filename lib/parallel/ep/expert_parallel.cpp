// The ExpertParallel style (include/dtensor/expert_parallel.h): experts' weights sharded by
// expert over the ep mesh, and the token exchange (token_dispatch.cpp) run around their calls
// on the module seam.
#include <dtensor/expert_parallel.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <optional>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <dtensor/dtensor.h>
#include <dtensor/module_hooks.h>
#include <dtensor/process_group.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "parallel/ep/capacity_dispatch.h"
#include "parallel/ep/token_dispatch.h"
#include "parallel/grad_reduce.h"
#include "tensor/dispatch/op_args.h"
#include "tensor/dtensor_impl.h"

namespace dtensor {

// [Note: expert parallelism on the seam]
// The style registers, on the experts module, a pre-forward hook that exchanges counts and
// dispatches the rows (the module then computes on its local experts only) and a post-forward
// hook that combines; on the router, a post-forward hook that starts the exchange of counts
// as soon as they exist. Both sit at hook_order::kExpertParallel, just inside tensor parallelism's
// layouts (and inside the activation checkpoint, so a recomputed block exchanges again rather than
// keeping the rows of the first run alive) and outside any user hook. The router hook and the
// experts hook meet in the style's state: the exchange in flight is keyed by the counts
// tensor it was started for, and an experts call whose counts are another tensor (a model
// that changed them in between) exchanges its own, synchronously; the stale one completes
// when dropped.

namespace {

std::mutex ep_stats_mutex;
EpStats ep_totals;

void add_ep_stats(const EpStats& d) {
  std::lock_guard<std::mutex> lock(ep_stats_mutex);
  ep_totals.calls += d.calls;
  ep_totals.early_exchanges += d.early_exchanges;
  ep_totals.rows_sent += d.rows_sent;
  ep_totals.rows_received += d.rows_received;
  ep_totals.wait_seconds += d.wait_seconds;
  ep_totals.capacity_calls += d.capacity_calls;
}

// [Note: expert parallelism in a simulated world] A simulated rank's router computes counts
// without values, and the all-to-alls' sizes are those values. The rank routes its rows evenly
// instead (the balance the load-balancing bias aims at): `rows` over `experts`, the remainder
// to the first experts, as host values the fake backend exchanges (identical ranks: every rank
// receives what it sends). The early exchange waits for the experts' hook, so the counts
// still move in one all-to-all per layer.
at::Tensor ep_even_counts(int64_t rows, int64_t experts) {
  at::Tensor c = at::full({experts}, rows / experts, at::kLong);
  c.narrow(0, 0, rows % experts).add_(1);
  return c;
}

void check_ep_mesh(const DeviceMesh& mesh, const torch::nn::Module& module) {
  DTENSOR_CHECK(mesh.defined() && mesh.ndim() == 1,
                "ExpertParallel on {}: the expert-parallel mesh must be 1-D, got {}", module.name(),
                mesh.defined() ? mesh.to_string() : "an undefined mesh");
}

} // namespace

struct ExpertParallel::State {
  std::mutex mutex;
  std::optional<detail::ep::CountsExchange> pending; // started by the router hook
  at::Tensor pending_counts;                         // held: no later tensor can take its address

  bool capacity = false; // no counts exchange: capacity dispatch carries them in its rows

  void start(const at::Tensor& counts, const Group& group) {
    if (capacity || (is_simulated() && !counts.is_cpu())) {
      return; // [Note: expert parallelism in a simulated world]: exchanged in the experts' hook
    }
    detail::ep::CountsExchange x = detail::ep::start_counts_exchange(counts, group, /*async=*/true);
    std::lock_guard<std::mutex> lock(mutex);
    pending = std::move(x); // a stale one completes as it is dropped
    pending_counts = counts;
    add_ep_stats(EpStats{.early_exchanges = 1});
  }
  detail::ep::CountsExchange take(const at::Tensor& counts, const Group& group) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (pending && pending_counts.is_same(counts)) {
        detail::ep::CountsExchange x = std::move(*pending);
        pending.reset();
        pending_counts = at::Tensor();
        return x;
      }
    }
    return detail::ep::start_counts_exchange(counts, group, /*async=*/false);
  }
};

ExpertParallel::ExpertParallel(ExpertParallelOptions options)
    : options_(options), state_(std::make_shared<State>()) {
  DTENSOR_CHECK(options_.capacity_factor() > 0 && std::isfinite(options_.capacity_factor()),
                "ExpertParallel: capacity_factor must be a positive number, got {}",
                options_.capacity_factor());
  DTENSOR_CHECK(options_.max_rows() >= 0, "ExpertParallel: max_rows must be >= 0, got {}",
                options_.max_rows());
  DTENSOR_CHECK(!options_.overlap() || options_.dispatch() == EpDispatch::Capacity,
                "ExpertParallel: overlap splits capacity buffers into chunks; it needs "
                "dispatch(EpDispatch::Capacity)");
  state_->capacity = options_.dispatch() == EpDispatch::Capacity;
}

EpStats ep_stats() {
  const auto [received, dropped] = detail::ep::take_device_rows();
  std::lock_guard<std::mutex> lock(ep_stats_mutex);
  ep_totals.rows_received += received;
  ep_totals.rows_dropped += dropped;
  return ep_totals;
}

void reset_ep_stats() {
  detail::ep::take_device_rows(); // dropped with the rest
  std::lock_guard<std::mutex> lock(ep_stats_mutex);
  ep_totals = EpStats{};
}

namespace {

// Every direct parameter [E, ...] -> Shard(0) on the ep mesh; all checked before any changes.
void shard_experts(torch::nn::Module& experts, const DeviceMesh& mesh) {
  const int64_t ep = mesh.size();
  auto params = experts.named_parameters(/*recurse=*/false);
  DTENSOR_CHECK(!params.is_empty(), "ExpertParallel on {}: the module has no parameters of its own",
                experts.name());
  for (const auto& p : params) {
    const at::Tensor& w = p.value();
    DTENSOR_CHECK(!is_dtensor(w), "ExpertParallel on {}: parameter '{}' is already a DTensor",
                  experts.name(), p.key());
    DTENSOR_CHECK(w.dim() >= 1 && w.size(0) % ep == 0,
                  "ExpertParallel on {}: parameter '{}' {} has {} experts (dim 0), not a multiple "
                  "of the {} ranks of the expert-parallel mesh {}",
                  experts.name(), p.key(), w.sizes(), w.dim() >= 1 ? w.size(0) : 0, ep,
                  mesh.to_string());
  }
  at::NoGradGuard no_grad;
  for (auto& p : params) {
    detail::replace_data(p.value(), distribute_tensor(p.value().detach(), mesh, {Shard(0)}));
  }
}

void check_experts_call(torch::nn::Module& m, const TensorList& in, const Group& group) {
  DTENSOR_CHECK(in.size() == 2 && in[0].defined() && in[0].dim() == 2 && in[1].defined() &&
                    in[1].dim() == 1 && in[1].scalar_type() == at::kLong,
                "ExpertParallel on {}: the experts' call takes rows [N, D] and counts [E] "
                "(int64); got {} tensors",
                m.name(), in.size());
  DTENSOR_CHECK(in[1].size(0) % group.size() == 0,
                "ExpertParallel on {}: {} experts cannot be split over the {} ranks of {}",
                m.name(), in[1].size(0), group.size(), group.to_string());
}

// A capacity call's buffers, and the overflow to refuse recorded.
detail::ep::CapacitySend send_rows(torch::nn::Module& m, const TensorList& in,
                                   const ExpertParallelOptions& options, const Group& group) {
  check_experts_call(m, in, group);
  const int64_t n = in[0].size(0);
  const int64_t max_rows = options.max_rows() > 0 ? options.max_rows() : n;
  const int64_t capacity =
      detail::ep::capacity_of(max_rows, options.capacity_factor(), group.size());
  detail::ep::CapacitySend send = detail::ep::capacity_send(in[0], in[1], capacity, group);
  if (options.overflow() == EpOverflow::Refuse) {
    detail::ep::record_overflow({.layer = m.name(),
                                 .group = group,
                                 .overflow = send.overflow,
                                 .counts = send.counts,
                                 .rows_and_counted = send.rows_and_counted,
                                 .capacity = capacity,
                                 .max_rows = max_rows,
                                 .factor = options.capacity_factor()});
  }
  add_ep_stats(EpStats{.calls = 1, .rows_sent = n, .capacity_calls = 1});
  return send;
}

// Overflow is checked once the backward that uses these rows ends: queued now in a recompute
// (which runs in it), by a hook on the rows' gradient after an ordinary forward, by the
// recompute after a checkpointed one; without autograd, where no backward will come, at the
// call.
void check_overflow_later(const ExpertParallelOptions& options, at::Tensor& out) {
  if (options.overflow() != EpOverflow::Refuse || is_simulated()) {
    return;
  }
  if (detail::in_backward()) {
    detail::ep::queue_overflow_check();
  } else if (out.requires_grad()) {
    out.register_hook([](const at::Tensor&) { detail::ep::queue_overflow_check(); });
  } else if (!detail::in_checkpoint_forward()) {
    detail::ep::check_overflow("at the call");
  }
}

// [Note: capacity dispatch] in capacity_dispatch.cpp; the seam's side of it: the plan kept
// from the experts' pre-forward to their post-forward, the overflow recorded for the check.
ModuleHooks capacity_hooks(const ExpertParallelOptions& options, const Group& group) {
  auto plans = std::make_shared<std::vector<detail::ep::CapacityPlan>>();
  ModuleHooks hooks;
  hooks.name("ExpertParallel").order(hook_order::kExpertParallel);
  hooks.pre_forward([options, group, plans](torch::nn::Module& m, TensorList& in) {
    detail::ep::CapacityPlan plan;
    plan.send = send_rows(m, in, options, group);
    auto [rows, chunk] = detail::ep::capacity_exchange(plan.send, 0, plan.send.capacity,
                                                       options.float8_dispatch(), group);
    plan.chunk = std::move(chunk);
    detail::ep::add_device_rows(plan.chunk.local_counts.sum(), plan.send.overflow.sum());
    in[0] = rows;
    in[1] = plan.chunk.local_counts;
    plans->push_back(std::move(plan));
  });
  hooks.post_forward([options, group, plans](torch::nn::Module& m, TensorList& out) {
    DTENSOR_CHECK(!plans->empty() && out.size() == 1,
                  "ExpertParallel on {}: the experts' forward must return one tensor, got {}",
                  m.name(), out.size());
    detail::ep::CapacityPlan plan = std::move(plans->back());
    plans->pop_back();
    out[0] = detail::ep::capacity_combine(out[0], plan, group);
    check_overflow_later(options, out[0]);
  });
  hooks.forward_failed([plans](torch::nn::Module&) {
    if (!plans->empty()) {
      plans->pop_back();
    }
  });
  return hooks;
}

// [Note: overlapped chunks]
// ExpertParallelOptions::overlap runs a capacity call as two chunks of the slots of every
// (source, destination) pair, [0, ceil(C/2)) and [ceil(C/2), C): both exchanges are issued
// first; chunk 0's experts run while chunk 1's rows travel; chunk 0's results start home and
// chunk 1's experts run while they travel; the two returns are waited for last. Each chunk is
// a capacity exchange of its own (its counts in its header, its rows expert-major), so the
// experts module is called twice, on its experts' rows grouped as always. The split is by
// slot, not by token: no size depends on the routing, nothing is read by the host, and every
// row computes what it would in one call. Backward interleaves the same way by itself ([Note:
// overlapped all-to-alls] in async_all_to_all.cpp). Per call: forward 4 all-to-alls, backward
// 4, the bytes of one call plus a header per chunk. A capacity of one slot is one exchange.
ModuleHooks overlapped_capacity_hooks(const ExpertParallelOptions& options, const Group& group) {
  ModuleHooks hooks;
  hooks.name("ExpertParallel").order(hook_order::kExpertParallel);
  hooks.around_forward([options, group](torch::nn::Module& m, const TensorList& in,
                                        const ForwardFn& forward) -> TensorList {
    const detail::ep::CapacitySend send = send_rows(m, in, options, group);
    if (send.capacity < 2) { // nothing to split: one exchange
      detail::ep::CapacityPlan plan{send, {}};
      auto [rows, chunk] = detail::ep::capacity_exchange(plan.send, 0, plan.send.capacity,
                                                         options.float8_dispatch(), group);
      plan.chunk = std::move(chunk);
      detail::ep::add_device_rows(plan.chunk.local_counts.sum(), plan.send.overflow.sum());
      TensorList out = forward({rows, plan.chunk.local_counts});
      DTENSOR_CHECK(out.size() == 1,
                    "ExpertParallel on {}: the experts' forward must return one tensor, got {}",
                    m.name(), out.size());
      at::Tensor y = detail::ep::capacity_combine(out[0], plan, group);
      check_overflow_later(options, y);
      return {y};
    }
    const int64_t half = (send.capacity + 1) / 2;
    std::vector<detail::ep::StartedChunk> started;
    const bool float8 = options.float8_dispatch();
    started.push_back(detail::ep::start_capacity_exchange(send, 0, half, float8, group));
    started.push_back(
        detail::ep::start_capacity_exchange(send, half, send.capacity, float8, group));
    std::vector<detail::ep::PendingAllToAll> returns;
    const at::Tensor none = at::zeros({}, send.overflow.options());
    detail::ep::add_device_rows(none, send.overflow.sum());
    for (detail::ep::StartedChunk& s : started) {
      auto [rows, chunk] = detail::ep::finish_capacity_exchange(s, group);
      detail::ep::add_device_rows(chunk.local_counts.sum(), none);
      TensorList out = forward({rows, chunk.local_counts});
      DTENSOR_CHECK(out.size() == 1,
                    "ExpertParallel on {}: the experts' forward must return one tensor, got {}",
                    m.name(), out.size());
      returns.push_back(detail::ep::start_capacity_return(out[0], chunk, group));
    }
    std::vector<at::Tensor> back;
    for (detail::ep::PendingAllToAll& r : returns) {
      back.push_back(r.wait());
    }
    at::Tensor y = detail::ep::capacity_gather(send, back);
    check_overflow_later(options, y);
    return {y};
  });
  return hooks;
}

} // namespace

void ExpertParallel::apply(torch::nn::Module& experts, const DeviceMesh& ep_mesh) const {
  check_ep_mesh(ep_mesh, experts);
  shard_experts(experts, ep_mesh);
  const Group group = ep_mesh.get_group();
  if (options_.dispatch() == EpDispatch::Capacity) {
    register_module_hooks(experts, options_.overlap() ? overlapped_capacity_hooks(options_, group)
                                                      : capacity_hooks(options_, group));
    return;
  }
  auto plans = std::make_shared<std::vector<detail::ep::ExchangePlan>>();
  auto state = state_;
  const bool float8 = options_.float8_dispatch();
  ModuleHooks hooks;
  hooks.name("ExpertParallel").order(hook_order::kExpertParallel);
  hooks.pre_forward([state, group, plans, float8](torch::nn::Module& m, TensorList& in) {
    DTENSOR_CHECK(in.size() == 2 && in[0].defined() && in[0].dim() == 2 && in[1].defined(),
                  "ExpertParallel on {}: the experts' call takes rows [N, D] and counts [E]; got "
                  "{} tensors",
                  m.name(), in.size());
    const auto start = std::chrono::steady_clock::now();
    const bool simulated = is_simulated() && !in[1].is_cpu();
    if (simulated) {
      in[1] = ep_even_counts(in[0].size(0), in[1].size(0));
    }
    detail::ep::CountsExchange x = state->take(in[1], group);
    x.work.wait();
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    detail::ep::ExchangePlan plan = detail::ep::plan_exchange(x.sent, x.received);
    const int64_t rows = x.sent.sum().item<int64_t>();
    DTENSOR_CHECK(in[0].size(0) == rows,
                  "ExpertParallel on {}: {} rows but the counts {} add up to {}", m.name(),
                  in[0].size(0), detail::describe(in[1]), rows);
    if (simulated) { // the plan's indices and counts on the rows' device
      plan.order = plan.order.to(in[0].device());
      plan.inverse = plan.inverse.to(in[0].device());
      plan.local_counts = plan.local_counts.to(in[0].device());
    }
    in[0] = detail::ep::dispatch(in[0], plan, float8, group);
    in[1] = plan.local_counts;
    add_ep_stats(EpStats{
        .calls = 1, .rows_sent = rows, .rows_received = in[0].size(0), .wait_seconds = waited});
    plans->push_back(std::move(plan));
  });
  hooks.post_forward([group, plans](torch::nn::Module& m, TensorList& out) {
    DTENSOR_CHECK(!plans->empty() && out.size() == 1,
                  "ExpertParallel on {}: the experts' forward must return one tensor, got {}",
                  m.name(), out.size());
    detail::ep::ExchangePlan plan = std::move(plans->back());
    plans->pop_back();
    out[0] = detail::ep::combine(out[0], plan, group);
  });
  hooks.forward_failed([plans](torch::nn::Module&) {
    if (!plans->empty()) {
      plans->pop_back();
    }
  });
  register_module_hooks(experts, std::move(hooks));
}

namespace {

// [Note: the router's gradients over ep] Each ep rank routes tokens of its own (ep borrows
// data-parallel ranks), so a parameter outside the experts has, on each rank, a gradient of
// that rank's tokens only: without a data-parallel wrapper reducing it over the ep ranks
// (fully_shard or replicate over a mesh that holds them, as torchtitan's FSDP over dp_shard x
// cp), the routers drift apart with no error. The router's parameters are checked at its first
// call, once the whole layout is applied and before any exchange starts, on every ep rank alike.
void check_router_reduced(torch::nn::Module& router, const Group& group) {
  std::vector<std::string> local;
  for (const auto& p : router.named_parameters()) {
    if (p.value().requires_grad() && !detail::gradient_reduced_over(p.value(), group.ranks())) {
      local.push_back(p.key());
    }
  }
  DTENSOR_CHECK(local.empty(),
                "ExpertParallel on router {}: parameters [{}] are not reduced over the ep ranks "
                "{}: each rank's gradient would cover its own tokens only and the routers would "
                "drift apart. Apply fully_shard or replicate over a mesh holding those ranks to "
                "the layer (its parameters outside the experts) after ExpertParallel",
                router.name(), fmt::join(local, ", "), group.ranks());
}

} // namespace

void ExpertParallel::apply_router(torch::nn::Module& router, const DeviceMesh& ep_mesh) const {
  check_ep_mesh(ep_mesh, router);
  const Group group = ep_mesh.get_group();
  auto state = state_;
  auto checked = std::make_shared<std::atomic<bool>>(false);
  register_module_hooks(
      router, ModuleHooks()
                  .name("ExpertParallel counts")
                  .order(hook_order::kExpertParallel)
                  .post_forward([state, group, checked](torch::nn::Module& m, TensorList& out) {
                    DTENSOR_CHECK(!out.empty(),
                                  "ExpertParallel on router {}: its forward returned no tensor; "
                                  "the last must be the counts [E]",
                                  m.name());
                    if (!checked->load()) {
                      check_router_reduced(m, group);
                      checked->store(true);
                    }
                    state->start(out.back(), group);
                  }));
}

} // namespace dtensor
