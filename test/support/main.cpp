// Catch2 main for multi-rank tests: joins the process group once per rank, gives every rank
// the same test order and seed, runs only the tests tagged for this world size ([worldN]),
// lets rank 0 report in full, and turns a failure on any rank into a failed run.
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>

#if __has_include(<catch2/catch_test_macros.hpp>)
#define DTENSOR_CATCH_V3 1
#include <catch2/catch_session.hpp>
#include <catch2/catch_test_case_info.hpp>
#include <catch2/reporters/catch_reporter_event_listener.hpp>
#include <catch2/reporters/catch_reporter_registrars.hpp>
#else
#define DTENSOR_CATCH_V3 0
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <ATen/Parallel.h>

#include "dist.h"

#ifndef DTENSOR_TEST_TIMEOUT_S
#define DTENSOR_TEST_TIMEOUT_S 60
#endif

namespace {

bool g_other_rank_failed = false;

// After each test case every rank reports (test-name hash, failed?) to all others: ranks
// that drifted to different tests are caught at once, and rank 0 names the failing ranks.
void sync_after_test(const std::string& name, bool failed) {
  auto info = at::tensor({static_cast<int64_t>(std::hash<std::string>()(name) & 0x7fffffff),
                          static_cast<int64_t>(failed ? 1 : 0)});
  at::Tensor all = dtensor::all_gather_tensor(info.to(dtensor::testing::options(at::kLong)), 0,
                                              dtensor::world_group())
                       .cpu()
                       .view({-1, 2});
  std::vector<int> failing;
  bool order_ok = true;
  for (int64_t r = 0; r < all.size(0); ++r) {
    if (all[r][0].item<int64_t>() != all[0][0].item<int64_t>()) {
      order_ok = false;
    }
    if (all[r][1].item<int64_t>() != 0) {
      failing.push_back(static_cast<int>(r));
    }
  }
  if (!failing.empty() && !failed) {
    g_other_rank_failed = true;
  }
  if (dtensor::get_rank() == 0 && !failing.empty()) {
    std::cerr << "[dtensor test] '" << name << "' failed on rank(s)";
    for (int r : failing) {
      std::cerr << ' ' << r;
    }
    std::cerr << '\n';
  }
  if (!order_ok) {
    std::cerr << "[dtensor test] rank " << dtensor::get_rank()
              << ": ranks ran different test cases; aborting\n";
    std::exit(3);
  }
}

#if DTENSOR_CATCH_V3
class RankSync : public Catch::EventListenerBase {
 public:
  using Catch::EventListenerBase::EventListenerBase;
  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    sync_after_test(stats.testInfo->name, stats.totals.assertions.failed > 0);
  }
};
CATCH_REGISTER_LISTENER(RankSync)
#else
class RankSync : public Catch::TestEventListenerBase {
 public:
  using Catch::TestEventListenerBase::TestEventListenerBase;
  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    sync_after_test(stats.testInfo.name, stats.totals.assertions.failed > 0);
  }
};
CATCH_REGISTER_LISTENER(RankSync)
#endif

} // namespace

int main(int argc, char** argv) {
  // Up to 4 ranks share 2 cores here: one intra-op thread per rank.
  at::set_num_threads(1);
  dtensor::init_process_group(
      dtensor::ProcessGroupOptions().timeout(std::chrono::seconds(DTENSOR_TEST_TIMEOUT_S)));
  const int rank = dtensor::get_rank();
  const int world = dtensor::get_world_size();

  Catch::Session session;
  if (int rc = session.applyCommandLine(argc, argv); rc != 0) {
    return rc;
  }
  auto& cfg = session.configData();
  if (cfg.testsOrTags.empty()) {
    cfg.testsOrTags.push_back("[world" + std::to_string(world) + "]");
  }
  // Same seed on every rank (Catch2 v3 would otherwise draw one per process).
  bool seed_given = false;
  for (int i = 1; i < argc; ++i) {
    seed_given = seed_given || std::string(argv[i]).rfind("--rng-seed", 0) == 0;
  }
  if (!seed_given) {
    cfg.rngSeed = 20261121;
  }
  if (rank != 0) {
#if DTENSOR_CATCH_V3
    cfg.reporterSpecifications.clear();
    cfg.reporterSpecifications.push_back(Catch::ReporterSpec("compact", {}, {}, {}));
#else
    cfg.reporterName = "compact";
#endif
  }
  at::manual_seed(cfg.rngSeed);
  int failed = session.run();
  dtensor::destroy_process_group();
  if (g_other_rank_failed && failed == 0) {
    std::cerr << "[dtensor test] rank " << rank << ": passed here, failed on another rank\n";
    return 1;
  }
  return failed == 0 ? 0 : 1;
}
