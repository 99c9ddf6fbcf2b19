// Expert parallelism's overlapped chunks (ExpertParallelOptions().overlap(true), [Note:
// overlapped chunks] in lib/parallel/ep/expert_parallel.cpp). Judges: the plain layer on one
// process (support/moe_reference.h) and the capacity dispatch of one exchange.
//  - world2 / world4: for every routing extreme the outputs and input gradients equal the
//    single exchange bit for bit (each row computes alone), the expert weights' gradients to
//    rounding (their sums come in two parts), and all equal the plain layer; 4 all-to-alls each
//    way with their exact bytes (a header per chunk).
//  - world2: a capacity of one slot is one exchange (values and counts of the single one).
//  - world2: the interleaving, from the flight recorder (each all-to-all's issue, and its
//    completion when waited for) read as each chunk's experts start in forward and as their
//    gradients arrive in backward: the other chunk's all-to-all is then issued and not waited
//    for. Values equal the single exchange.
//  - world2 / world4: with float8 dispatch, the overlapped chunks equal the single float8
//    exchange (outputs and input gradients bit for bit); overlap refuses the variable dispatch.
#include <nlohmann/json.hpp>

#include <dtensor/expert_parallel.h>
#include <dtensor/flight_recorder.h>
#include <dtensor/module_hooks.h>

#include "support/moe_reference.h"

using namespace moe_test; // NOLINT(google-build-using-namespace): the shared judge
using dtensor::EpDispatch;
using dtensor::EpOverflow;
using dtensor::ExpertParallelOptions;

namespace {

// The all-to-alls in this rank's flight record, in issue order: completed (waited for) or not.
std::vector<bool> all_to_alls() {
  const nlohmann::json record = nlohmann::json::parse(dtensor::flight_record_json());
  std::vector<bool> done;
  for (const auto& e : record.at("entries")) {
    if (e.at("op").get<std::string>() == "all_to_all_single") {
      done.push_back(e.at("state").get<std::string>() == "completed");
    }
  }
  return done;
}

// One step of the layer with its experts over the world's ranks (12 tokens each): the output,
// the input's gradient and this rank's w1 gradient, and the step's collective counts.
std::pair<std::vector<at::Tensor>, std::string> run_layer(const MoEArgs& args,
                                                          const ExpertParallelOptions& options) {
  DeviceMesh mesh = ep_mesh_of_world();
  MoE m = make_moe(args, 9);
  ExpertParallel(options).apply(*m->experts, mesh);
  at::manual_seed(4);
  at::Tensor x = at::randn({12, 16}).requires_grad_();
  CommDebugMode mode;
  at::Tensor out = dtensor::call(m, x);
  out.sum().backward();
  return {{out.detach(), x.grad(), DTensor(m->experts->w1.grad()).to_local()},
          counts_text(mode.comm_counts())};
}

} // namespace

TEST_CASE("overlapped chunks equal the single exchange and the plain layer for every routing "
          "extreme; 4 all-to-alls each way, exact bytes",
          "[world2][world4]") {
  const int64_t d = 16, ep = world(), local = 8 / ep;
  for (const RoutingCase& c : routing_extremes()) {
    INFO(c.what);
    const int64_t max_rows = 12 * c.args.top_k();
    const auto options = capacity(static_cast<double>(ep), max_rows).overflow(EpOverflow::Drop);
    EpRun one = check_ep(c.args, c.rows, false, c.setup, options);
    EpRun two =
        check_ep(c.args, c.rows, false, c.setup, ExpertParallelOptions(options).overlap(true));
    REQUIRE(one.results.size() == two.results.size());
    CHECK(at::equal(one.results[0], two.results[0])); // output
    CHECK(at::equal(one.results[1], two.results[1])); // input gradient
    for (size_t i = 2; i < one.results.size(); ++i) {
      INFO("weight gradient " << i);
      CHECK(at::allclose(one.results[i], two.results[i], 1e-6, 1e-7));
    }
    CHECK(two.received == one.received);
    CHECK(two.fwd == "all_to_all 4");
    CHECK(two.bwd == "all_to_all 4");
    // Two chunks of C / 2 slots (C = max_rows, even), each after its own header; back: C rows.
    const int64_t sent = ep * (2 * header_rows(local, d) + max_rows) * d * 4;
    const int64_t back = ep * max_rows * d * 4;
    CHECK(two.fwd_bytes == sent + back);
    CHECK(two.bwd_bytes == sent + back);
  }
}

TEST_CASE("a capacity of one slot is not split: the single exchange's values and counts",
          "[world2]") {
  // C = 1: most rows dropped. The single exchange's drops are judged by the plain layer on the
  // kept tokens (test_moe_capacity); here it judges the overlapped path's fallback.
  const auto options = capacity(1.0, 1).overflow(EpOverflow::Drop);
  const MoEArgs args = small().hidden_dim(64);
  const auto [one, one_counts] = run_layer(args, options);
  const auto [two, two_counts] = run_layer(args, ExpertParallelOptions(options).overlap(true));
  for (size_t i = 0; i < one.size(); ++i) {
    INFO("result " << i);
    CHECK(at::equal(one[i], two[i]));
  }
  CHECK(one_counts == "all_to_all 4");
  CHECK(two_counts == "all_to_all 4");
}

TEST_CASE("overlapped chunks interleave: each chunk's experts run, forward and backward, while "
          "the other chunk's all-to-all is in flight (flight recorder)",
          "[world2]") {
  DeviceMesh mesh = ep_mesh_of_world();
  const MoEArgs args = small().hidden_dim(64);
  const auto options = capacity(2.0, 24).overflow(EpOverflow::Drop);
  MoE plain = make_moe(args, 9);
  MoE m = make_moe(args, 9);
  ExpertParallel(options).apply(*plain->experts, mesh);
  ExpertParallel(ExpertParallelOptions(options).overlap(true)).apply(*m->experts, mesh);
  // What the record holds, past what was there before the step, as each chunk starts.
  std::vector<std::vector<bool>> forward, backward;
  size_t before = 0;
  auto probe = dtensor::register_module_hooks(
      *m->experts,
      dtensor::ModuleHooks()
          .name("probe")
          .pre_forward([&](torch::nn::Module&, dtensor::TensorList&) {
            const std::vector<bool> all = all_to_alls();
            forward.emplace_back(all.begin() + static_cast<int64_t>(before), all.end());
          })
          .pre_backward([&](torch::nn::Module&) {
            const std::vector<bool> all = all_to_alls();
            backward.emplace_back(all.begin() + static_cast<int64_t>(before), all.end());
          }));
  at::manual_seed(4);
  at::Tensor x = at::randn({12, 16}).requires_grad_();
  at::Tensor xp = x.detach().clone().requires_grad_();
  at::Tensor g = at::randn({12, 16});
  before = all_to_alls().size();
  at::Tensor out = dtensor::call(m, x);
  (out * g).sum().backward();
  CHECK(all_to_alls().size() - before == 8);
  at::Tensor ref = dtensor::call(plain, xp);
  (ref * g).sum().backward();
  CHECK(at::equal(out, ref));
  CHECK(at::equal(x.grad(), xp.grad()));
  // Forward: dispatch 0, dispatch 1, return 0, return 1. Chunk 0's experts start with dispatch
  // 1 in flight; chunk 1's with return 0 in flight.
  REQUIRE(forward.size() == 2);
  CHECK(forward[0] == std::vector<bool>{true, false});
  CHECK(forward[1] == std::vector<bool>{true, true, false});
  // Backward, after the forward's four (all waited for): the returns' gradients (1 then 0)
  // issued; chunk 1's gradients arrive with return 0's in flight, chunk 0's with chunk 1's
  // dispatch gradient in flight.
  REQUIRE(backward.size() == 2);
  CHECK(backward[0] == std::vector<bool>{true, true, true, true, true, false});
  CHECK(backward[1] == std::vector<bool>{true, true, true, true, true, true, false});
  probe.remove();
}

TEST_CASE("overlapped chunks with float8 dispatch equal the single float8 exchange; overlap "
          "refuses the variable dispatch",
          "[world2][world4]") {
  const int64_t ep = world();
  const std::vector<int64_t> even(static_cast<size_t>(ep), 12);
  const MoEArgs args = small().hidden_dim(64).num_shared_experts(1);
  const auto options = capacity(static_cast<double>(ep), 24).float8_dispatch(true);
  // The single float8 exchange is judged by the plain layer fed torchao's rowwise cast
  // (test_moe_capacity); here it judges the overlapped chunks.
  const auto [one, one_counts] = run_layer(args, options);
  const auto [two, two_counts] = run_layer(args, ExpertParallelOptions(options).overlap(true));
  CHECK(at::equal(one[0], two[0]));
  CHECK(at::equal(one[1], two[1]));
  CHECK(at::allclose(one[2], two[2], 1e-6, 1e-7));
  CHECK(one_counts == "all_gather 1, all_to_all 4");
  CHECK(two_counts == "all_gather 1, all_to_all 8");
  REQUIRE_THROWS_WITH(ExpertParallel(ExpertParallelOptions().overlap(true)),
                      contains("overlap") && contains("dispatch(EpDispatch::Capacity)"));
}
