// collective_cost: NCCL's tuning model by algorithm on the cluster table
// (dtensor/collective_cost.h). Guards each algorithm's time against its closed form written out
// here from NCCL's published constants (latency: base + steps x link latency; bandwidth: the
// bus bandwidth, capped per protocol, times nranks / nsteps), NCCL's choice between them (LL
// rings for small all-reduces in a node, NVLS for large ones, Simple rings across nodes),
// which algorithms each case enables, the CPU row, and the time model's use of a row.
#include <numeric>

#include <dtensor/collective_cost.h>
#include <dtensor/simulate.h>

#include "support/prelude.h"

using dtensor::cluster_spec;
using dtensor::collective_cost;
using dtensor::collective_costs;
using dtensor::CollectiveAlgorithm;
using dtensor::CollectiveCost;
using dtensor::CollectiveProtocol;

namespace {

std::vector<int> ranks(int n, int first = 0) {
  std::vector<int> r(static_cast<size_t>(n));
  std::iota(r.begin(), r.end(), first);
  return r;
}

const CollectiveCost& find(const std::vector<CollectiveCost>& all, CollectiveAlgorithm a,
                           CollectiveProtocol p) {
  for (const auto& c : all) {
    if (c.algorithm == a && c.protocol == p) {
      return c;
    }
  }
  FAIL("no " << dtensor::to_string(a) << " / " << dtensor::to_string(p));
  return all.front();
}

bool near_s(double got, double want) {
  return std::abs(got - want) <= 1e-12 + 1e-9 * want;
}

constexpr double kGiB = 1024.0 * 1024 * 1024;

} // namespace

TEST_CASE("collective_cost: one H100 node's all-reduce by algorithm against the closed forms; "
          "LL rings for small buffers, NVLS for large",
          "[collective_cost][world1]") {
  const auto h100 = cluster_spec("h100");
  const double nvlink = 18 * 20.6; // GB/s
  const auto all = collective_costs(CollectiveKind::AllReduce, 1LL << 30, ranks(8), h100);
  CHECK(all.size() == 7); // ring x 3 protocols, tree x 3, NVLS
  // Ring / Simple: 8.4 us + 2 (8 - 1) steps x 3.4 us; 2 (k - 1) / k of the bytes at the bus rate.
  const auto& ring = find(all, CollectiveAlgorithm::Ring, CollectiveProtocol::Simple);
  CHECK(ring.steps == 14);
  CHECK(near_s(ring.seconds, (8.4 + 14 * 3.4) * 1e-6 + kGiB / (nvlink * 8.0 / 14 * 1e9)));
  // Tree / Simple: 8.4 us + 2 x 7 x 4.0 us; min(0.92 bus, 16 x 38.7) x 0.85 (pattern) x 0.5.
  const auto& tree = find(all, CollectiveAlgorithm::Tree, CollectiveProtocol::Simple);
  CHECK(
      near_s(tree.seconds, (8.4 + 2 * 7 * 4.0) * 1e-6 + kGiB / (nvlink * 0.92 * 0.85 * 0.5 * 1e9)));
  // NVLS: one switch round trip (25 us); the switch reduces: 2 x 0.85 x 15 / 16 of NVLink.
  const auto& nvls = find(all, CollectiveAlgorithm::Nvls, CollectiveProtocol::Simple);
  CHECK(near_s(nvls.seconds, 25e-6 + kGiB / (nvlink * 0.85 * 15.0 / 16 * 2 * 8.0 / 14 * 1e9)));
  CHECK(collective_cost(CollectiveKind::AllReduce, 1LL << 30, ranks(8), h100).algorithm ==
        CollectiveAlgorithm::Nvls);
  // 1 KiB: Ring / LL, 6.6 us + 14 x 0.6 us, min(141, bus / 2) GB/s.
  const CollectiveCost small = collective_cost(CollectiveKind::AllReduce, 1024, ranks(8), h100);
  CHECK(small.algorithm == CollectiveAlgorithm::Ring);
  CHECK(small.protocol == CollectiveProtocol::LL);
  CHECK(near_s(small.seconds, (6.6 + 14 * 0.6) * 1e-6 + 1024 / (141 * 8.0 / 14 * 1e9)));
  // The choice is the cheapest, and more bytes never cost less.
  double last = 0;
  for (int64_t bytes = 1; bytes <= (1LL << 32); bytes *= 4) {
    const auto chosen = collective_cost(CollectiveKind::AllReduce, bytes, ranks(8), h100);
    for (const auto& c : collective_costs(CollectiveKind::AllReduce, bytes, ranks(8), h100)) {
      CHECK(chosen.seconds <= c.seconds);
    }
    CHECK(chosen.seconds >= last);
    last = chosen.seconds;
  }
}

TEST_CASE("collective_cost: across nodes, rings cross at the network's latency, trees by "
          "log2(nodes), NVLS only inside a node, LL128 on at most 2 nodes",
          "[collective_cost][world1]") {
  const auto h100 = cluster_spec("h100");
  // All-gather of 256 MiB over 64 ranks (8 nodes): 63 steps, 7 of them across nodes.
  const double bytes = 256.0 * 1024 * 1024;
  const auto ag = collective_costs(CollectiveKind::AllGather, 1LL << 28, ranks(64), h100);
  CHECK(ag.size() == 2); // ring LL and Simple: no LL128 past 2 nodes, no NVLS across nodes
  const auto& simple = find(ag, CollectiveAlgorithm::Ring, CollectiveProtocol::Simple);
  CHECK(
      near_s(simple.seconds, (8.4 + 56 * 3.4 + 7 * 14.0) * 1e-6 + bytes / (45 * 64.0 / 63 * 1e9)));
  const auto& ll = find(ag, CollectiveAlgorithm::Ring, CollectiveProtocol::LL);
  // LL: the intra-node steps at least the network overhead (1 us), min(35, 45 / 2) GB/s.
  CHECK(near_s(ll.seconds, (6.6 + 56 * 1.0 + 7 * 2.7) * 1e-6 + bytes / (22.5 * 64.0 / 63 * 1e9)));
  CHECK(collective_cost(CollectiveKind::AllGather, 1LL << 28, ranks(64), h100).protocol ==
        CollectiveProtocol::Simple);
  // All-reduce over 2 nodes: NVLSTree, 25 us + 2 log2(2) x 20.9 us, capped at 57.7 GB/s.
  const auto ar = collective_costs(CollectiveKind::AllReduce, 1LL << 30, ranks(16), h100);
  CHECK(ar.size() == 7); // ring x 3, tree x 3, NVLSTree
  const auto& nvls_tree = find(ar, CollectiveAlgorithm::NvlsTree, CollectiveProtocol::Simple);
  CHECK(near_s(nvls_tree.seconds, (25 + 2 * 20.9) * 1e-6 + kGiB / (57.7 * 16.0 / 30 * 1e9)));
  // Tree / LL over 2 nodes: 6.8 us + 2 (7 x 0.6 + 1 x 5.0) us.
  const auto& tree_ll = find(ar, CollectiveAlgorithm::Tree, CollectiveProtocol::LL);
  CHECK(near_s(tree_ll.latency_s, (6.8 + 2 * (7 * 0.6 + 5.0)) * 1e-6));
  // Ring / Simple all-reduce across nodes: 2 (nodes - 1) crossings, and NCCL's 1.4 on latency.
  const auto& ring = find(ar, CollectiveAlgorithm::Ring, CollectiveProtocol::Simple);
  CHECK(near_s(ring.latency_s, 1.4 * (8.4 + 28 * 3.4 + 2 * 14.0) * 1e-6));
  // GB200: 72 GPUs on one NVLink domain, so 64 ranks stay inside it: NVLS for a large
  // all-reduce; NVLS all-gathers only up to 32 ranks of a node (NCCL's rule).
  const auto gb200 = cluster_spec("gb200");
  CHECK(collective_cost(CollectiveKind::AllReduce, 1LL << 30, ranks(64), gb200).algorithm ==
        CollectiveAlgorithm::Nvls);
  CHECK(collective_costs(CollectiveKind::AllGather, 1LL << 28, ranks(64), gb200).size() == 3);
  CHECK(collective_costs(CollectiveKind::AllGather, 1LL << 28, ranks(32), gb200).size() == 4);
}

TEST_CASE("collective_cost: all-to-all, sends, the CPU row, one rank, unknown rows",
          "[collective_cost][world1]") {
  const auto h100 = cluster_spec("h100");
  // All-to-all of 64 MiB over 16 ranks on 2 nodes: 7/16 of it over NVLink and 8/16 over the
  // network, concurrently; one latency (8.4 + 14 us).
  const double bytes = 64.0 * 1024 * 1024;
  const auto a2a = collective_cost(CollectiveKind::AllToAll, 1LL << 26, ranks(16), h100);
  CHECK(a2a.algorithm == CollectiveAlgorithm::Pairwise);
  CHECK(near_s(a2a.seconds, (8.4 + 14.0) * 1e-6 +
                                std::max(bytes * 7 / 16 / (18 * 20.6e9), bytes * 8 / 16 / 45e9)));
  const auto send = collective_cost(CollectiveKind::Send, 1 << 20, {3, 11}, h100);
  CHECK(near_s(send.seconds, (8.4 + 14.0) * 1e-6 + (1 << 20) / 45e9));
  const auto recv = collective_cost(CollectiveKind::Recv, 1 << 20, {3, 4}, h100);
  CHECK(near_s(recv.seconds, (8.4 + 3.4) * 1e-6));
  // The CPU row: Gloo's ring, 240 us a step, 0.95 GB/s.
  const auto cpu = cluster_spec("cpu");
  CHECK(near_s(collective_cost(CollectiveKind::AllReduce, 4096, ranks(2), cpu).seconds,
               2 * 240e-6 + 4096 / 0.95e9));
  CHECK(near_s(collective_cost(CollectiveKind::AllGather, 1 << 20, ranks(4), cpu).seconds,
               3 * 240e-6 + 0.75 * (1 << 20) / 0.95e9));
  CHECK(collective_costs(CollectiveKind::AllReduce, 1 << 20, {5}, h100).empty());
  CHECK(collective_cost(CollectiveKind::AllReduce, 1 << 20, {5}, h100).seconds == 0);
  CHECK_THROWS_WITH(cluster_spec("a100"), Catch::Contains("no row 'a100'") &&
                                              Catch::Contains("h100, h200, b200, gb200, cpu"));
  for (const auto& name : dtensor::cluster_names()) {
    CHECK(cluster_spec(name).name() == name);
  }
}

TEST_CASE("collective_cost: the time model with a cluster row costs each collective by its "
          "chosen algorithm",
          "[collective_cost][world1]") {
  dtensor::CollectiveRecord ag;
  ag.kind = CollectiveKind::AllGather;
  ag.ranks = ranks(8);
  ag.bytes_in = 1 << 25;
  ag.bytes_out = 1 << 28; // NCCL's size: the gathered buffer
  const auto h100 = cluster_spec("h100");
  const auto options = dtensor::TimeModelOptions().cluster(h100);
  CHECK(dtensor::collective_seconds(ag, options) ==
        collective_cost(CollectiveKind::AllGather, 1 << 28, ranks(8), h100).seconds);
  dtensor::CollectiveRecord rs = ag;
  rs.kind = CollectiveKind::ReduceScatter;
  rs.bytes_in = 1 << 28; // the scattered buffer
  rs.bytes_out = 1 << 25;
  CHECK(dtensor::collective_seconds(rs, options) ==
        collective_cost(CollectiveKind::ReduceScatter, 1 << 28, ranks(8), h100).seconds);
  // Without a row, the ring's alpha-beta as before.
  CHECK(dtensor::collective_seconds(ag, dtensor::TimeModelOptions()) ==
        Approx(7 * 8e-6 + 7.0 / 8 * (1 << 28) / 360e9));
}

TEST_CASE("redistribute_cost: shortest paths of direct transitions satisfy the triangle "
          "inequality; a direct all-to-all can cost more than a detour",
          "[collective_cost][world1]") {
  using dtensor::Placement;
  const std::vector<Placement> placements = {Placement::replicate(), Placement::partial(),
                                             Placement::shard(0), Placement::shard(1)};
  bool detour_seen = false;
  for (const std::string name : {"h100", "gb200", "cpu"}) {
    const auto cluster = cluster_spec(name);
    for (const int n : {8, 64}) {
      for (int64_t bytes = 1024; bytes <= (1LL << 30); bytes *= 32) {
        INFO(name << ", " << n << " ranks, " << bytes << " bytes");
        const auto cost = [&](const Placement& a, const Placement& b) {
          return dtensor::redistribute_cost(a, b, 2, bytes, ranks(n), cluster);
        };
        for (const auto& a : placements) {
          for (const auto& c : placements) {
            const auto ac = cost(a, c);
            // The path's steps add up to its cost and it ends where asked.
            double sum = 0;
            for (size_t i = 0; i + 1 < ac.path.size(); ++i) {
              sum += dtensor::direct_redistribute_seconds(ac.path[i], ac.path[i + 1], bytes,
                                                          ranks(n), cluster);
            }
            CHECK(near_s(sum, ac.seconds));
            CHECK(ac.path.front() == a);
            CHECK(ac.path.back() == c);
            CHECK(ac.seconds <=
                  dtensor::direct_redistribute_seconds(a, c, bytes, ranks(n), cluster));
            for (const auto& b : placements) {
              CHECK(ac.seconds <= cost(a, b).seconds + cost(b, c).seconds + 1e-15);
            }
            detour_seen = detour_seen || ac.path.size() > 2;
          }
        }
      }
    }
  }
  CHECK(detour_seen);
  // On H100, 1 KiB Shard(0) -> Shard(1) over 8 ranks: the all-to-all of the 128-byte pieces
  // (8.4 + 3.4 us) costs more than an LL ring's all-gather (6.6 + 7 x 0.6 us) and a free chunk.
  const auto h100 = cluster_spec("h100");
  const auto s01 =
      dtensor::redistribute_cost(Placement::shard(0), Placement::shard(1), 2, 1024, ranks(8), h100);
  CHECK(s01.path ==
        std::vector<Placement>{Placement::shard(0), Placement::replicate(), Placement::shard(1)});
  CHECK(dtensor::direct_redistribute_seconds(Placement::shard(0), Placement::shard(1), 1024,
                                             ranks(8), h100) > s01.seconds);
  // Shard -> Partial has no direct way: it goes through Replicate (an all-gather).
  const auto s0p = dtensor::redistribute_cost(Placement::shard(0), Placement::partial(), 2, 1 << 20,
                                              ranks(8), h100);
  CHECK(s0p.path.size() == 3);
  CHECK(s0p.path[1] == Placement::replicate());
}
