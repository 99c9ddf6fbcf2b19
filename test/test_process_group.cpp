// Process group: environment, world group, cached subgroups, errors.
#include <cstdlib>

#include <dtensor/device_stats.h>

#include "mesh/dispatch_keys.h"
#include "support/prelude.h"

TEST_CASE("world group matches the torchrun environment", "[pg][world1][world2][world4]") {
  const char* env_world = std::getenv("WORLD_SIZE");
  const char* env_rank = std::getenv("RANK");
  REQUIRE(world() == (env_world ? std::atoi(env_world) : 1));
  REQUIRE(rank() == (env_rank ? std::atoi(env_rank) : 0));
  auto g = dtensor::world_group();
  REQUIRE(g.size() == world());
  REQUIRE(g.rank() == rank());
  REQUIRE(g.label() == "world");
  std::vector<int> all;
  for (int r = 0; r < world(); ++r) {
    all.push_back(r);
  }
  REQUIRE(g.ranks() == all);
  REQUIRE(dtensor::is_initialized());
  REQUIRE(g.backend_type() == dtensor::get_backend());
  REQUIRE(g.timeout() == std::chrono::milliseconds(std::chrono::seconds(DTENSOR_TEST_TIMEOUT_S)));
}

TEST_CASE("init_process_group twice is an error", "[pg][world1][world2][world4]") {
  REQUIRE_THROWS_WITH(dtensor::init_process_group(), contains("already initialized"));
}

TEST_CASE("new_group creates each communicator once", "[pg][world2][world4]") {
  int64_t before = dtensor::num_groups_created();
  // Pairs {0,1}, {2,3}, ...: each rank is in exactly one.
  int base = rank() - rank() % 2;
  auto g = dtensor::new_group({base, base + 1}, "pair");
  REQUIRE(g.defined());
  REQUIRE(g.size() == 2);
  REQUIRE(g.rank() == rank() % 2);
  REQUIRE(g.label() == "pair");
  auto again = dtensor::new_group({base, base + 1});
  REQUIRE(again == g);
  REQUIRE(again.label() == "ranks[" + std::to_string(base) + ", " + std::to_string(base + 1) + "]");
  // On 2 ranks the pair is the whole world (the world group, reused); on 4 it is new and
  // the second call reuses it.
  REQUIRE(dtensor::num_groups_created() - before == (world() == 2 ? 0 : 1));

  // The whole world in order is the world group itself.
  std::vector<int> all;
  for (int r = 0; r < world(); ++r) {
    all.push_back(r);
  }
  REQUIRE(dtensor::new_group(all) == dtensor::world_group());

  // A group over the pair reversed is another communicator with swapped group ranks.
  auto reversed = dtensor::new_group({base + 1, base});
  REQUIRE(reversed != g);
  REQUIRE(reversed.rank() == 1 - rank() % 2);
  auto t = dtensor::testing::tensor({static_cast<double>(reversed.rank())});
  auto gathered = dtensor::all_gather_tensor(t, 0, reversed);
  REQUIRE(dtensor::testing::same(gathered, dtensor::testing::tensor({0, 1})));
}

TEST_CASE("new_group: non-members get an undefined group", "[pg][world4]") {
  auto g = dtensor::new_group({0, 3});
  REQUIRE(g.defined() == (rank() == 0 || rank() == 3));
  if (!g.defined()) {
    auto t = dtensor::testing::tensor({1});
    REQUIRE_THROWS_WITH(dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, g),
                        contains("all_reduce: undefined group"));
    REQUIRE_THROWS_WITH(g.size(), contains("undefined group"));
  } else {
    auto t = dtensor::testing::tensor({static_cast<double>(rank())});
    dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, g);
    REQUIRE(t.item<float>() == 3.0f);
  }
}

TEST_CASE("new_group rejects bad rank lists", "[pg][world1][world2][world4]") {
  int w = world();
  REQUIRE_THROWS_WITH(dtensor::new_group({}), contains("empty rank list"));
  REQUIRE_THROWS_WITH(dtensor::new_group({0, w}),
                      contains("rank " + std::to_string(w) + " in [0, " + std::to_string(w) +
                               "] is out of range for world size " + std::to_string(w)));
  REQUIRE_THROWS_WITH(dtensor::new_group({0, 0}), contains("rank 0 appears twice in [0, 0]"));
}

// Hidden ([.]): run only by fail_fast.py to prove that an assertion failing on one rank
// fails the whole run, and that rank 0 names the failing rank.
TEST_CASE("harness self-check: fails on rank 1 only", "[.][harness-self-check]") {
  auto t = dtensor::testing::tensor({1});
  dtensor::all_reduce_(t, dtensor::ReduceOp::Sum, dtensor::world_group());
  REQUIRE(t.item<float>() == static_cast<float>(world()));
  CHECK(rank() != 1);
}

// A library that renames PrivateUse1 (an out-of-tree device) cannot share the process with
// dtensor: init_process_group says so, naming the key and the device. Renaming is for the
// process's life, so this case runs alone in its own test (dispatch-keys-w1, test/meson.build).
TEST_CASE("another library's PrivateUse1 device is refused by name", "[dispatch_keys]") {
  REQUIRE(dtensor::detail::dispatch_key_conflicts().empty()); // LibTorch alone: nothing noted
  c10::register_privateuse1_backend("npu");
  const auto conflicts = dtensor::detail::dispatch_key_conflicts();
  REQUIRE(conflicts.size() == 1);
  REQUIRE_THAT(conflicts[0], contains("PrivateUse1 is the device 'npu' of another library"));
  // init_process_group checks the keys first (before "already initialized").
  REQUIRE_THROWS_WITH(dtensor::init_process_group(),
                      contains("dtensor cannot share this process with a library that uses the "
                               "c10 dispatch keys it occupies") &&
                          contains("'npu'"));
}

// Guards the device figures behind MFU and the memory metrics ([Note: device figures]): the
// peak table's rows as NVIDIA's datasheets give them (dense), the order that keeps a longer
// name from matching a shorter row, and the CPU's answers (no caching allocator).
TEST_CASE("device figures: peak TFLOPs by device name, none for the CPU", "[pg][world1]") {
  CHECK(dtensor::peak_tflops("NVIDIA H100 80GB HBM3", false) == 989);
  CHECK(dtensor::peak_tflops("NVIDIA H100 80GB HBM3", true) == 1979);
  CHECK(dtensor::peak_tflops("NVIDIA H100 NVL", false) == 835);
  CHECK(dtensor::peak_tflops("NVIDIA H100 PCIe", true) == 1513);
  CHECK(dtensor::peak_tflops("NVIDIA H200", false) == 989);
  CHECK(dtensor::peak_tflops("NVIDIA B200", true) == 4500);
  CHECK(dtensor::peak_tflops("NVIDIA GB200", false) == 2500);
  CHECK(dtensor::peak_tflops("NVIDIA A100-SXM4-80GB", false) == 312);
  CHECK(dtensor::peak_tflops("NVIDIA A100-SXM4-80GB", true) == 0); // no fp8 on an A100
  CHECK(dtensor::peak_tflops("cpu", false) == 0);
  CHECK(dtensor::device_name(c10::Device(c10::kCPU)) == "cpu");
  const dtensor::DeviceMemoryStats cpu = dtensor::device_memory_stats(c10::Device(c10::kCPU));
  CHECK(!cpu.available);
  CHECK(cpu.max_active_bytes == 0);
}

// Guards the live CPU tensor bytes the recipe reports on a CPU ([Note: counting host memory]):
// nothing before count_host_memory(); then a tensor's bytes exactly, while it lives and in the
// peak until reset; a tensor allocated before the counter frees without disturbing it.
TEST_CASE("device figures: live CPU tensor bytes counted from count_host_memory on",
          "[pg][world1]") {
  at::Tensor before = at::ones({1000}, at::kFloat);
  if (!dtensor::host_memory_stats().counting) { // the first case of this process to count
    CHECK(dtensor::host_memory_stats().live_bytes == 0);
  }
  dtensor::count_host_memory();
  dtensor::count_host_memory(); // once per process
  const dtensor::HostMemoryStats start = dtensor::host_memory_stats();
  REQUIRE(start.counting);
  dtensor::reset_peak_host_memory();
  {
    at::Tensor t = at::empty({1 << 18}, at::kFloat); // 1 MiB
    const dtensor::HostMemoryStats held = dtensor::host_memory_stats();
    CHECK(held.live_bytes - start.live_bytes == (1 << 20));
    CHECK(held.max_live_bytes >= held.live_bytes);
  }
  before.reset(); // allocated before the counter: not counted, freed through the right deleter
  const dtensor::HostMemoryStats after = dtensor::host_memory_stats();
  CHECK(after.live_bytes == start.live_bytes);
  CHECK(after.max_live_bytes - start.live_bytes >= (1 << 20));
  dtensor::reset_peak_host_memory();
  CHECK(dtensor::host_memory_stats().max_live_bytes == after.live_bytes);
}
