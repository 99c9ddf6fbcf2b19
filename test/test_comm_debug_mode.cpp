// CommDebugMode: exact counts by kind and by mesh dimension, bytes, nesting, scoping,
// thread-locality (and the threads that carry a captured ThreadLocalState), table and JSON.
#include <future>
#include <thread>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include "mesh/comm_debug.h"
#include "support/prelude.h"

TEST_CASE("CommDebugMode counts each collective once, with its bytes", "[comm_mode][world1][world2][world4]") {
  auto g = init_device_mesh(device_type(), {world()}, {"dp"}).get_group();
  int64_t n = g.size();
  auto t = at::ones({4, 8}, options()); // 128 bytes
  CommDebugMode mode;
  REQUIRE(mode.total_count() == 0);
  dtensor::all_reduce_(t, ReduceOp::Sum, g);
  dtensor::all_reduce_(t, ReduceOp::Avg, g); // emulated average is still one collective
  auto gathered = dtensor::all_gather_tensor(t, 1, g);
  auto scattered = dtensor::reduce_scatter_tensor(gathered, ReduceOp::Sum, 1, g);
  auto swapped = dtensor::all_to_all_single(at::ones({4 * n}, options()), {}, {}, g);
  dtensor::broadcast_(t, 0, g);
  dtensor::barrier(g);

  REQUIRE(mode.total_count() == 7);
  auto counts = mode.comm_counts();
  REQUIRE(counts.size() == 6);
  REQUIRE(counts.at(CollectiveKind::AllReduce) == 2);
  REQUIRE(counts.at(CollectiveKind::AllGather) == 1);
  REQUIRE(counts.at(CollectiveKind::ReduceScatter) == 1);
  REQUIRE(counts.at(CollectiveKind::AllToAll) == 1);
  REQUIRE(counts.at(CollectiveKind::Broadcast) == 1);
  REQUIRE(counts.at(CollectiveKind::Barrier) == 1);
  REQUIRE(mode.count(CollectiveKind::AllReduce) == 2);
  REQUIRE(mode.count("dp", CollectiveKind::AllReduce) == 2);
  REQUIRE(mode.count("tp", CollectiveKind::AllReduce) == 0);

  // bytes_in: what this rank hands over; bytes_out: what it gets back.
  REQUIRE(mode.bytes_in(CollectiveKind::AllReduce) == 2 * 128);
  REQUIRE(mode.bytes_in(CollectiveKind::AllGather) == 128);
  REQUIRE(mode.records()[2].bytes_out == 128 * n);
  REQUIRE(mode.bytes_in(CollectiveKind::ReduceScatter) == 128 * n);
  REQUIRE(mode.records()[3].bytes_out == 128);
  REQUIRE(mode.bytes_in(CollectiveKind::AllToAll) == 16 * n);
  REQUIRE(mode.bytes_in(CollectiveKind::Broadcast) == 128);
  REQUIRE(mode.bytes_in(CollectiveKind::Barrier) == 0);
  REQUIRE(mode.total_bytes_in() == 2 * 128 + 128 + 128 * n + 16 * n + 128);
  REQUIRE(mode.records()[1].op == ReduceOp::Avg);
  REQUIRE(mode.records()[0].shape == std::vector<int64_t>{4, 8});
  REQUIRE(mode.records()[0].dtype == at::kFloat);
  REQUIRE(mode.records()[0].ranks == g.ranks());
  REQUIRE(mode.records()[0].group == "dp");

  mode.reset();
  REQUIRE(mode.total_count() == 0);
}

TEST_CASE("CommDebugMode attributes collectives to mesh dimensions", "[comm_mode][world4]") {
  auto mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
  auto t = at::ones({2}, options());
  CommDebugMode mode;
  dtensor::all_reduce_(t, ReduceOp::Sum, mesh.get_group("dp"));
  dtensor::all_reduce_(t, ReduceOp::Max, mesh.get_group("tp"));
  dtensor::all_reduce_(t, ReduceOp::Sum, mesh.get_group("tp"));
  auto g = dtensor::all_gather_tensor(t, 0, mesh["tp"].get_group());
  auto by_group = mode.counts_by_group();
  REQUIRE(by_group.size() == 2);
  REQUIRE(by_group.at("dp").at(CollectiveKind::AllReduce) == 1);
  REQUIRE(by_group.at("tp").at(CollectiveKind::AllReduce) == 2);
  REQUIRE(by_group.at("tp").at(CollectiveKind::AllGather) == 1);
  REQUIRE(mode.count("dp", CollectiveKind::AllGather) == 0);
  // Values: the dp sum gives 2, the tp max keeps 2, the tp sum gives 4.
  REQUIRE(t.cpu()[0].item<float>() == 4.0f);
}

TEST_CASE("CommDebugMode scopes nest and end", "[comm_mode][world1][world2][world4]") {
  auto g = dtensor::world_group();
  auto t = at::ones({3}, options());
  dtensor::all_reduce_(t, ReduceOp::Sum, g); // before any scope: recorded nowhere
  REQUIRE_FALSE(dtensor::detail::comm_debug_active());
  CommDebugMode outer;
  dtensor::all_reduce_(t, ReduceOp::Sum, g);
  {
    CommDebugMode inner;
    dtensor::barrier(g);
    dtensor::all_reduce_(t, ReduceOp::Sum, g);
    REQUIRE(inner.total_count() == 2);
    REQUIRE(inner.count(CollectiveKind::Barrier) == 1);
  }
  dtensor::broadcast_(t, 0, g);
  REQUIRE(outer.total_count() == 4);
  REQUIRE(outer.count(CollectiveKind::AllReduce) == 2);
  REQUIRE(outer.count(CollectiveKind::Barrier) == 1);
  REQUIRE(outer.count(CollectiveKind::Broadcast) == 1);
}

TEST_CASE("CommDebugMode is thread-local", "[comm_mode][world1][world2][world4]") {
  auto g = dtensor::world_group();
  CommDebugMode here;
  int64_t seen_there = -1;
  // Another thread issues a collective under its own scope; this thread's scope must not
  // see it, and it must not see this thread's.
  std::thread other([&] {
    CommDebugMode there;
    auto t = at::ones({1}, options());
    dtensor::all_reduce_(t, ReduceOp::Sum, g);
    seen_there = there.total_count();
  });
  other.join();
  REQUIRE(seen_there == 1);
  REQUIRE(here.total_count() == 0);
}

TEST_CASE("CommDebugMode sees collectives of threads under its captured ThreadLocalState",
          "[comm_mode][world1][world2][world4]") {
  // As autograd's engine runs a CUDA backward on its device threads: the issuing thread's
  // state is captured and installed on the worker with at::ThreadLocalStateGuard.
  auto g = dtensor::world_group();
  CommDebugMode outer;
  CommDebugMode inner;
  const at::ThreadLocalState captured;
  std::thread worker([&] {
    at::ThreadLocalStateGuard guard(captured);
    auto t = at::ones({3}, options());
    dtensor::all_reduce_(t, ReduceOp::Sum, g);
  });
  worker.join();
  REQUIRE(inner.count(CollectiveKind::AllReduce) == 1);
  REQUIRE(outer.count(CollectiveKind::AllReduce) == 1);
  REQUIRE(inner.records()[0].bytes_in == 12);

  // at::launch (the inter-op pool) carries the state the same way.
  std::promise<void> done;
  at::launch([&] {
    auto t = at::ones({2}, options());
    dtensor::all_gather_tensor(t, 0, g);
    done.set_value();
  });
  done.get_future().wait();
  REQUIRE(inner.count(CollectiveKind::AllGather) == 1);
  REQUIRE(outer.total_count() == 2);

  // (A thread that does not install the state is not seen: "CommDebugMode is thread-local".)
  // A captured state outliving its scopes: the worker's collective goes nowhere, no crash.
  std::optional<at::ThreadLocalState> late;
  {
    CommDebugMode short_lived;
    late.emplace();
  }
  std::thread after([&] {
    at::ThreadLocalStateGuard guard(*late);
    auto t = at::ones({1}, options());
    dtensor::all_reduce_(t, ReduceOp::Sum, g);
  });
  after.join();
  REQUIRE(outer.total_count() == 3); // `late` was captured inside `outer` too
}

TEST_CASE("CommDebugMode table and JSON", "[comm_mode][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  auto t = at::ones({2, 2}, options());
  CommDebugMode mode;
  dtensor::all_reduce_(t, ReduceOp::Sum, mesh.get_group());
  auto g = dtensor::all_gather_tensor(t, 0, mesh.get_group());
  std::string table = mode.table();
  REQUIRE_THAT(table, contains("CommDebugMode: 2 collective(s), 32 bytes in, " +
                                   std::to_string(16 + 16 * world()) + " bytes out"));
  REQUIRE_THAT(table, contains("all_reduce"));
  REQUIRE_THAT(table, contains("\ndp "));
  REQUIRE_THAT(table, contains("\ntotal "));
  std::string json = mode.json();
  REQUIRE_THAT(json, contains("\"total_count\":2"));
  REQUIRE_THAT(json, contains("\"counts\":{\"all_reduce\":1,\"all_gather\":1}"));
  REQUIRE_THAT(json, contains("\"by_group\":{\"dp\":{\"all_reduce\":1,\"all_gather\":1}}"));
  REQUIRE_THAT(json, contains("\"kind\":\"all_gather\",\"group\":\"dp\""));
  REQUIRE_THAT(json, contains("\"shape\":[2,2],\"bytes_in\":16,\"bytes_out\":" + std::to_string(16 * world())));
}
