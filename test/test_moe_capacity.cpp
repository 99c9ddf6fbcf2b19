// Expert parallelism's capacity dispatch (ExpertParallelOptions().dispatch(EpDispatch::Capacity),
// [Note: capacity dispatch] in lib/parallel/ep/capacity_dispatch.cpp). Judges: the plain layer
// on one process (support/moe_reference.h) and the variable dispatch, bit for bit in fp32.
//  - world2 / world4: with room for every row, capacity equals variable bit for bit (outputs,
//    input, expert and gate gradients) for even routing, every row to rank 0's experts, a rank
//    with no tokens and top-k = E, and both equal the plain layer; 2 all-to-alls each way with
//    their exact bytes (header rows included), the refusal's one all-gather per backward.
//  - world2 / world4: a batch built to overflow: refused at the end of the backward (and at the
//    call without autograd; after the backward under activation checkpointing, whose first
//    forward runs without autograd) with the same text on every rank, naming the ranks, experts,
//    rows and capacity; dropped rows are zeros with zero gradients, the kept ones equal the plain
//    layer on the kept tokens, the dropped count reported. Counts that do not add up to the rows
//    on one rank: refused by the same check (no rank fails alone before the all-to-all).
//  - world2 / world4: float8 dispatch, by either path: the plain layer whose experts see each
//    row cast to float8 and back as torchao's rowwise recipe defines it, values and gradients
//    (straight through the cast); D + 4 bytes a row dispatched, the combine in fp32.
//  - world2: capacity dispatch under float8 grouped experts equals the variable dispatch bit
//    for bit (the padding rows left out of the float8 products).
//  - world2: no host read between the router and the combine: the layer's forward and backward
//    run under a guard that records reads of tensor values by the host (item, a device tensor
//    copied to the CPU, nonzero); none with capacity dispatch (overlapped chunks too), some with
//    variable dispatch (the guard works). Reads inside the grouped product are its CPU
//    kernel's (CUDA's takes device offsets).
#include <atomic>

#include <ATen/record_function.h>

#include <dtensor/activation_checkpoint.h>
#include <dtensor/expert_parallel.h>

#include <models/moe/float8.h>

#include "support/moe_reference.h"

using namespace moe_test; // NOLINT(google-build-using-namespace): the shared judge
using dtensor::EpDispatch;
using dtensor::EpOverflow;
using dtensor::ExpertParallelOptions;

namespace {

// The whole-batch rows of every rank's first `kept` tokens (rank r holds rows_per_rank of them).
at::Tensor kept_rows(int64_t rows_per_rank, int64_t kept) {
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < world(); ++r) {
    parts.push_back(at::arange(r * rows_per_rank, r * rows_per_rank + kept));
  }
  return at::cat(parts);
}

struct KernelMark : at::ObserverContext {};

// Reads of tensor values by the host on this thread while it lives.
class HostReadGuard {
 public:
  HostReadGuard() {
    current = this;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&HostReadGuard::enter, &HostReadGuard::exit).needsInputs(true));
  }
  ~HostReadGuard() {
    at::removeCallback(handle_);
    current = nullptr;
  }
  HostReadGuard(const HostReadGuard&) = delete;
  HostReadGuard& operator=(const HostReadGuard&) = delete;
  std::vector<std::string> reads;

 private:
  // The grouped product's CPU kernel reads its offsets (CUDA's takes them on the device): the
  // reads inside it are the kernel's, not the dispatch's.
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    const std::string name = fn.name();
    if (name == "aten::_grouped_mm") {
      ++inside_kernel;
      return std::make_unique<KernelMark>();
    }
    if (inside_kernel > 0) {
      return nullptr;
    }
    bool read = name == "aten::_local_scalar_dense" || name == "aten::item" ||
                name == "aten::nonzero" || name == "aten::masked_select";
    const auto inputs = fn.inputs();
    if ((name == "aten::to" || name == "aten::_to_copy") && !inputs.empty() &&
        inputs[0].isTensor() && !inputs[0].toTensor().is_cpu()) {
      for (const c10::IValue& v : inputs) { // a device tensor copied to the host
        read = read || (v.isDevice() && v.toDevice().is_cpu());
      }
    }
    if (read && current != nullptr) {
      current->reads.push_back(name);
    }
    return nullptr;
  }
  static void exit(const at::RecordFunction&, at::ObserverContext* kernel) {
    if (kernel != nullptr) {
      --inside_kernel;
    }
  }
  static thread_local HostReadGuard* current;
  static thread_local int inside_kernel;
  at::CallbackHandle handle_;
};
thread_local HostReadGuard* HostReadGuard::current = nullptr;
thread_local int HostReadGuard::inside_kernel = 0;

} // namespace

TEST_CASE("capacity dispatch with room for every row equals the variable dispatch bit for bit "
          "and the plain layer, for every routing extreme; 2 all-to-alls each way, exact bytes",
          "[world2][world4]") {
  const int64_t d = 16, ep = world();
  const std::vector<RoutingCase> cases = routing_extremes();
  for (size_t i = 0; i < cases.size(); ++i) {
    const RoutingCase& c = cases[i];
    INFO(c.what);
    const bool early = i < 2; // the router hook on the first two
    const int64_t max_rows = 12 * c.args.top_k(), local = 8 / ep;
    EpRun v = check_ep(c.args, c.rows, early, c.setup);
    EpRun k = check_ep(c.args, c.rows, early, c.setup, capacity(static_cast<double>(ep), max_rows));
    REQUIRE(v.results.size() == k.results.size());
    for (size_t r = 0; r < v.results.size(); ++r) {
      INFO("result " << r);
      CHECK(at::equal(v.results[r], k.results[r]));
    }
    CHECK(k.received == v.received);
    CHECK(k.fwd == a2a(2));
    CHECK(k.bwd == "all_gather 1, all_to_all 2"); // the overflow check ends the backward
    // C = max_rows rows to each rank (factor ep), H header rows before them; back: C rows.
    const int64_t sent = ep * (header_rows(local, d) + max_rows) * d * 4;
    const int64_t back = ep * max_rows * d * 4;
    CHECK(k.fwd_bytes == sent + back);
    CHECK(k.bwd_bytes == sent + back);
  }
}

TEST_CASE("capacity dispatch's overflow: refused after the backward or at the call, the same "
          "text on every rank; dropped rows give zeros and no gradient",
          "[world2][world4]") {
  const int64_t d = 16, ep = world(), tokens = 8;
  const int64_t cap = (tokens + ep - 1) / ep; // factor 1: C = ceil(8 / ep)
  const MoEArgs args = small().top_k(1);
  auto to_expert_0 = [](MoEImpl& m) { m.expert_bias.narrow(0, 0, 1).fill_(100.0); };
  DeviceMesh mesh = ep_mesh_of_world();
  at::manual_seed(4);
  at::Tensor x = at::randn({ep * tokens, d});
  at::Tensor g = at::randn({ep * tokens, d});
  at::Tensor xl = x.narrow(0, rank() * tokens, tokens).clone().requires_grad_();
  at::Tensor gl = g.narrow(0, rank() * tokens, tokens);
  std::string per_expert = std::to_string(tokens);
  for (int64_t e = 1; e < 8 / ep; ++e) {
    per_expert += ", 0";
  }
  const std::string named = "ep rank 0 routed " + std::to_string(tokens) + " rows to experts 0.." +
                            std::to_string(8 / ep - 1) + " of ep rank 0 (rows per expert [" +
                            per_expert + "]), " + std::to_string(tokens - cap) +
                            " over the capacity of " + std::to_string(cap) +
                            " rows (capacity_factor 1 x max_rows " + std::to_string(tokens) +
                            " / ep " + std::to_string(ep) + ")";
  SECTION("refused: after the backward, and at the call without autograd") {
    MoE m = make_moe(args, 9);
    to_expert_0(*m);
    ExpertParallel(capacity(1.0)).apply(*m->experts, mesh);
    at::Tensor out = dtensor::call(m, xl); // the check waits for the backward
    REQUIRE_THROWS_WITH((out * gl).sum().backward(),
                        contains(named) && contains("refused at the end of the backward"));
    at::NoGradGuard no_grad;
    REQUIRE_THROWS_WITH(dtensor::call(m, xl), contains(named) && contains("refused at the call"));
  }
  SECTION("refused after the backward under activation checkpointing (its first forward runs "
          "without autograd; the recompute, inside the backward, checks)") {
    MoE m = make_moe(args, 9);
    to_expert_0(*m);
    ExpertParallel(capacity(1.0)).apply(*m->experts, mesh);
    at::Tensor out = dtensor::activation_checkpoint(
        [&m](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
          return {dtensor::call(m, in[0])};
        },
        {xl})[0];
    REQUIRE_THROWS_WITH((out * gl).sum().backward(),
                        contains(named) && contains("refused at the end of the backward"));
  }
  SECTION("counts that do not add up to the rows (rank 0's add up to 3 more): nothing fails on "
          "one rank alone, the check names the call, rank and both numbers") {
    MoE m = make_moe(args, 9);
    ExpertParallel(capacity(2.0)).apply(*m->experts, mesh);
    at::Tensor counts = at::zeros({8}, at::kLong);
    counts[0] = tokens + (rank() == 0 ? 3 : 0);
    at::Tensor out = dtensor::call(m->experts, xl, counts);
    REQUIRE_THROWS_WITH(
        (out * gl).sum().backward(),
        contains("ep rank 0 called the experts with " + std::to_string(tokens) +
                 " rows but counts adding up to " + std::to_string(tokens + 3) +
                 "; refused at the end of the backward"));
  }
  SECTION("dropped: zeros past the capacity, the kept tokens as the plain layer") {
    MoE plain = make_moe(args, 9);
    MoE m = make_moe(args, 9);
    to_expert_0(*plain);
    to_expert_0(*m);
    ExpertParallel(capacity(1.0).overflow(EpOverflow::Drop)).apply(*m->experts, mesh);
    dtensor::reset_ep_stats();
    at::Tensor out;
    {
      CommDebugMode mode;
      out = dtensor::call(m, xl);
      (out * gl).sum().backward();
      CHECK(counts_text(mode.comm_counts()) == a2a(4)); // no check: nothing is refused
    }
    CHECK(dtensor::ep_stats().rows_dropped == tokens - cap);
    at::Tensor kept = kept_rows(tokens, cap);
    Reference r = run_reference(*plain, x.index_select(0, kept), g.index_select(0, kept));
    CHECK(near(out.narrow(0, 0, cap), r.out.narrow(0, rank() * cap, cap)));
    CHECK(near(xl.grad().narrow(0, 0, cap), r.x.grad().narrow(0, rank() * cap, cap)));
    CHECK(at::equal(out.narrow(0, cap, tokens - cap), at::zeros({tokens - cap, d})));
    CHECK(at::equal(xl.grad().narrow(0, cap, tokens - cap), at::zeros({tokens - cap, d})));
    const int64_t local = 8 / ep;
    CHECK(near(DTensor(m->experts->w1.grad()).to_local(),
               r.w1.grad().narrow(0, rank() * local, local)));
    CHECK(near(DTensor(m->experts->w2.grad()).to_local(),
               r.w2.grad().narrow(0, rank() * local, local)));
  }
}

namespace {

// A row cast to float8 and back as torchao's rowwise recipe defines it: scale = 448 / amax (in
// fp64, then fp32) rounded down to a power of two, row x scale saturated to e4m3, then over the
// scale. Straight through: the value of the round trip, the gradient of the row.
at::Tensor float8_round_trip(const at::Tensor& row) {
  const at::Tensor r = row.detach();
  at::Tensor scale =
      (r.abs().max().to(at::kDouble).clamp_min(1e-12).reciprocal() * 448.0).to(at::kFloat);
  scale = at::exp2(at::floor(at::log2(scale)));
  at::Tensor q = (r * scale).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn).to(at::kFloat) / scale;
  return q + (row - r);
}

} // namespace

TEST_CASE("float8 dispatch: the experts see each row cast to float8 and back (torchao's rowwise "
          "cast), values and gradients as the plain layer so fed; D + 4 bytes a row dispatched, "
          "the combine and gradients in the rows' dtype",
          "[world2][world4]") {
  const int64_t d = 16, ep = world(), rows = 12 * 2, local = 8 / ep;
  const MoEArgs args = small().num_shared_experts(1);
  const std::vector<int64_t> even(static_cast<size_t>(ep), 12);
  SECTION("variable dispatch") {
    EpRun run = check_ep(args, even, true, {}, ExpertParallelOptions().float8_dispatch(true),
                         float8_round_trip);
    CHECK(run.fwd == a2a(3));
    CHECK(run.fwd_bytes == 8 * 8 + rows * (d + 4) + run.received * d * 4);
    CHECK(run.bwd_bytes == rows * d * 4 + run.received * d * 4);
  }
  SECTION("capacity dispatch") {
    EpRun run =
        check_ep(args, even, false, {},
                 capacity(static_cast<double>(ep), rows).float8_dispatch(true), float8_round_trip);
    const int64_t head = (local * 8 + d + 4 - 1) / (d + 4); // header rows of D + 4 bytes
    CHECK(run.fwd == a2a(2));
    CHECK(run.fwd_bytes == ep * (head + rows) * (d + 4) + ep * rows * d * 4);
    CHECK(run.bwd_bytes == 2 * ep * rows * d * 4);
  }
}

TEST_CASE("capacity dispatch under float8 grouped experts (their products on the grouped rows "
          "only, the padding left out) equals the variable dispatch bit for bit",
          "[world2]") {
  const MoEArgs args = small().dim(32).hidden_dim(64);
  const std::vector<int64_t> even(static_cast<size_t>(world()), 12);
  auto to_float8 = [](MoEImpl& m) {
    CHECK(dtensor::models::convert_grouped_experts_to_float8(m).size() == 1);
  };
  // The plain reference does not compute in float8: the two dispatches judge each other here,
  // the float8 products themselves are torchao's judgement (test_float8).
  auto results = [&](const ExpertParallelOptions& options) {
    DeviceMesh mesh = ep_mesh_of_world();
    MoE m = make_moe(args, 9);
    to_float8(*m);
    ExpertParallel(options).apply(*m->experts, mesh);
    at::manual_seed(4);
    at::Tensor x = at::randn({12, 32}).requires_grad_();
    at::Tensor out = dtensor::call(m, x);
    out.sum().backward();
    return std::vector<at::Tensor>{out.detach(), x.grad(),
                                   DTensor(m->experts->w1.grad()).to_local()};
  };
  const auto v = results({});
  const auto k = results(capacity(static_cast<double>(world()), 24));
  for (size_t i = 0; i < v.size(); ++i) {
    INFO("result " << i);
    CHECK(at::equal(v[i], k[i]));
  }
}

TEST_CASE("capacity dispatch reads no tensor value on the host between the router and the "
          "combine, forward or backward; the variable dispatch does (the guard sees reads)",
          "[world2]") {
  DeviceMesh mesh = ep_mesh_of_world();
  at::manual_seed(4);
  at::Tensor x = at::randn({12, 16}).requires_grad_();
  const std::vector<std::pair<std::string, ExpertParallelOptions>> modes = {
      {"capacity", capacity(2.0).overflow(EpOverflow::Drop)},
      {"capacity, overlapped chunks", capacity(2.0).overflow(EpOverflow::Drop).overlap(true)},
      {"variable", ExpertParallelOptions()}};
  for (const auto& [how, options] : modes) {
    INFO(how);
    const bool with_capacity = options.dispatch() == EpDispatch::Capacity;
    MoE m = make_moe(small().num_shared_experts(1), 9);
    ExpertParallel(options).apply(*m->experts, mesh);
    std::vector<std::string> reads;
    {
      HostReadGuard guard;
      dtensor::call(m, x).sum().backward();
      reads = guard.reads;
    }
    std::string seen;
    for (const std::string& r : reads) {
      seen += (seen.empty() ? "" : ", ") + r;
    }
    INFO("host reads: [" << seen << "]");
    CHECK(reads.empty() == with_capacity);
  }
}
