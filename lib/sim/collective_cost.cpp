// Collectives by algorithm: NCCL's tuning model on a row of the device / network table
// ([Note: collectives by algorithm] below; dtensor/collective_cost.h).
#include <dtensor/collective_cost.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <set>

#include "internal/check.h"

namespace dtensor {

// [Note: collectives by algorithm] NCCL picks, for each call, the (algorithm, protocol) pair
// its tuning model predicts fastest (src/graph/tuning.cc, ncclTopoGetAlgoTime; the table in
// src/enqueue.cc): time = latency + bytes / algorithm bandwidth, with
//  - the bus bandwidth of the group's slowest link per GPU (NVLink inside one node, the
//    network across nodes), capped per protocol (LL: half of it and llMaxBw; LL128: 0.92 of it
//    and a per-channel cap; Simple: all of it) and per algorithm (Tree: 0.92, a per-channel
//    cap, then 0.85 for its pattern; NVLS: the switch's efficiency x (channels - 1) /
//    channels, twice for an all-reduce (the switch reduces), (ppn - 1) / ppn otherwise);
//  - the algorithm bandwidth from it: Ring and NVLS move bytes x nsteps / nranks over each
//    link (nsteps 2 (k - 1) for all-reduce, k - 1 for all-gather / reduce-scatter), Tree half;
//  - the latency: a base per (algorithm, protocol), plus a hardware latency per step on its
//    link (a Ring's steps inside nodes at NVLink's, its 2 (nodes - 1) (all-reduce) or nodes -
//    1 crossings at the network's; a Tree's 2 x ((ppn - 1) NVLink + log2(nodes) network
//    steps); NVLS one switch round trip (25 us) and a tree of nodes for NVLSTree).
// Enabled as NCCL enables them: Tree and NVLSTree for all-reduce only, NVLS on one node of
// an NVSwitch system (across nodes it needs CollNet, which the table does not model), LL128
// on at most 2 nodes. The constants are NCCL 2.28-2.30's for Hopper and Blackwell. Left out:
// the size-dependent correction of Tree's bandwidth, CollNet and PAT, the CPU vendor's
// effect on LL across nodes (Intel's assumed). NCCL has no model for all-to-all or
// point-to-point: all-to-all is modelled as concurrent pairwise sends (each rank's bytes to
// its node's peers over NVLink and to the others over the network, in parallel, one
// latency), a send as one transfer on its link. The CPU row is Gloo's ring: `steps` latencies
// of step_latency_us plus its bytes at the measured bandwidth.

namespace {

constexpr size_t kLL = 0, kLL128 = 1, kSimple = 2;

struct AlgorithmTable {
  std::array<double, 3> base_latency_us;    // LL, LL128, Simple
  std::array<double, 3> nvlink_latency_us;  // per step on NVLink
  std::array<double, 3> network_latency_us; // per step across nodes
};

// NCCL's baseLat and hwLat (NVLINK, NET rows); NVLS / NVLSTree are Simple only.
const AlgorithmTable kRing{{6.6, 14.0, 8.4}, {0.6, 1.9, 3.4}, {2.7, 4.0, 14.0}};
const AlgorithmTable kTree{{6.8, 14.0, 8.4}, {0.6, 1.25, 4.0}, {5.0, 8.5, 14.0}};
const AlgorithmTable kNvls{{0, 0, 0}, {0, 0, 25.0}, {0, 0, 18.0}};
const AlgorithmTable kNvlsTree{{0, 0, 0}, {0, 0, 25.0}, {0, 0, 20.9}};
constexpr double kNetOverheadUs = 1.0; // an Intel host's

// Per generation, by nodes (1, 2, more): NCCL's llMaxBws, per-channel caps, NVLS efficiency.
struct GenerationTable {
  std::array<double, 3> ll_max;
  double ring_ll128_per_channel;
  std::array<double, 3> tree_ll128_per_channel;
  std::array<double, 3> tree_per_channel;
  std::array<double, 3> nvls_tree_max;
  double nvls_efficiency;
};
const GenerationTable kHopper{{141, 45, 35},   36.7, {36.7, 36.7, 29.0}, {38.7, 41.4, 36.0},
                              {0, 57.7, 45.5}, 0.85};
const GenerationTable kBlackwell{{282, 90, 70},    40.0,        {55.6, 31.67, 20.0},
                                 {70, 42.8, 24.0}, {0, 96, 80}, 0.74};

struct GroupShape {
  double k = 0;     // ranks
  double nodes = 0; // distinct nodes among them
  double ppn = 0;   // ranks per node (k / nodes)
  size_t row = 0;   // 0: one node, 1: two, 2: more
};

GroupShape shape_of(const std::vector<int>& ranks, int64_t per_node) {
  std::set<int> nodes;
  for (int r : ranks) {
    nodes.insert(static_cast<int>(r / per_node));
  }
  GroupShape s;
  s.k = static_cast<double>(ranks.size());
  s.nodes = static_cast<double>(nodes.size());
  s.ppn = s.k / s.nodes;
  s.row = nodes.size() == 1 ? 0 : nodes.size() == 2 ? 1 : 2;
  return s;
}

int64_t nccl_steps(CollectiveKind kind, double k) {
  const auto n = static_cast<int64_t>(k);
  switch (kind) {
  case CollectiveKind::AllReduce:
    return 2 * (n - 1);
  case CollectiveKind::AllGather:
  case CollectiveKind::ReduceScatter:
  case CollectiveKind::AllToAll:
    return n - 1;
  case CollectiveKind::Send:
  case CollectiveKind::Recv:
    return 1;
  default:
    return n;
  }
}

CollectiveCost priced(CollectiveAlgorithm a, CollectiveProtocol p, double latency_us,
                      double algo_gbps, double bytes, int64_t steps) {
  CollectiveCost c;
  c.algorithm = a;
  c.protocol = p;
  c.latency_s = latency_us * 1e-6;
  c.bandwidth_gbps = algo_gbps;
  c.seconds = c.latency_s + (algo_gbps > 0 ? bytes / (algo_gbps * 1e9) : 0.0);
  c.steps = steps;
  return c;
}

// The CPU row: Gloo's ring, `steps` latencies and the ring's bytes.
CollectiveCost gloo_cost(CollectiveKind kind, double bytes, const GroupShape& s,
                         const ClusterSpec& c) {
  const int64_t steps = nccl_steps(kind, s.k);
  const double latency = static_cast<double>(steps) * c.step_latency_us();
  const double moved = kind == CollectiveKind::Send        ? 1.0
                       : kind == CollectiveKind::Recv      ? 0.0
                       : kind == CollectiveKind::AllReduce ? 2 * (s.k - 1) / s.k
                       : kind == CollectiveKind::Broadcast ? 1.0
                                                           : (s.k - 1) / s.k;
  const double gbps = moved > 0 ? c.nvlink_gbps() / moved : 0.0;
  return priced(CollectiveAlgorithm::Ring, CollectiveProtocol::Simple, latency, gbps, bytes, steps);
}

// Ring's three protocols.
void ring_costs(CollectiveKind kind, double bytes, const GroupShape& s, const ClusterSpec& c,
                const GenerationTable& g, std::vector<CollectiveCost>& out) {
  const double bus = s.nodes == 1 ? c.nvlink_gbps() : c.network_gbps();
  const auto ch = static_cast<double>(c.channels());
  const int64_t steps = nccl_steps(kind, s.k);
  const double inter = s.nodes == 1                        ? 0
                       : kind == CollectiveKind::AllReduce ? 2 * (s.nodes - 1)
                                                           : s.nodes - 1;
  const std::array<double, 3> bw{std::min(g.ll_max[s.row], bus * 0.5),
                                 std::min(bus * 0.92, ch * g.ring_ll128_per_channel), bus};
  for (size_t p : {kLL, kLL128, kSimple}) {
    if (p == kLL128 && s.row == 2) {
      continue;
    }
    double intra_lat = kRing.nvlink_latency_us[p];
    if (s.nodes > 1) {
      intra_lat = std::max(intra_lat, kNetOverheadUs * (p == kSimple ? 3.0 : 1.0));
    }
    double lat = kRing.base_latency_us[p] + (static_cast<double>(steps) - inter) * intra_lat +
                 inter * kRing.network_latency_us[p];
    if (p == kSimple && kind == CollectiveKind::AllReduce && s.nodes > 1 &&
        bytes / (ch * s.k) >= 64) {
      lat *= 1.4;
    }
    out.push_back(priced(CollectiveAlgorithm::Ring, static_cast<CollectiveProtocol>(p), lat,
                         bw[p] * s.k / static_cast<double>(steps), bytes, steps));
  }
}

// All-reduce's trees: NCCL's double binary tree, and NVLSTree across nodes.
void tree_costs(double bytes, const GroupShape& s, const ClusterSpec& c, const GenerationTable& g,
                std::vector<CollectiveCost>& out) {
  const double bus = s.nodes == 1 ? c.nvlink_gbps() : c.network_gbps();
  const auto ch = static_cast<double>(c.channels());
  const int64_t steps = nccl_steps(CollectiveKind::AllReduce, s.k);
  const std::array<double, 3> bw{std::min(bus / 3.8, g.ll_max[s.row]),
                                 std::min(bus * (s.nodes == 1 ? 7.0 / 9.0 : 120.0 / 128.0),
                                          ch * g.tree_ll128_per_channel[s.row]),
                                 std::min(bus * 0.92, ch * g.tree_per_channel[s.row])};
  for (size_t p : {kLL, kLL128, kSimple}) {
    if (p == kLL128 && s.row == 2) {
      continue;
    }
    const double lat =
        kTree.base_latency_us[p] + 2 * ((s.ppn - 1) * kTree.nvlink_latency_us[p] +
                                        std::log2(s.nodes) * kTree.network_latency_us[p]);
    out.push_back(priced(CollectiveAlgorithm::Tree, static_cast<CollectiveProtocol>(p), lat,
                         bw[p] * 0.85 * 0.5, bytes, steps));
  }
  if (c.nvls() && s.nodes > 1) {
    const double intra = c.nvlink_gbps() * g.nvls_efficiency * (ch - 1) / ch * 2;
    const double inter_bw = c.network_gbps() * (s.nodes <= 2 ? 2.0 : 1.0);
    const double capped = std::min({intra, inter_bw, g.nvls_tree_max[s.row]});
    const double lat = kNvlsTree.nvlink_latency_us[kSimple] +
                       2 * std::log2(s.nodes) * kNvlsTree.network_latency_us[kSimple];
    out.push_back(priced(CollectiveAlgorithm::NvlsTree, CollectiveProtocol::Simple, lat,
                         capped * s.k / static_cast<double>(steps), bytes, steps));
  }
}

// NVLink SHARP inside one node: the switch reduces (all-reduce) or multicasts.
void nvls_cost(CollectiveKind kind, double bytes, const GroupShape& s, const ClusterSpec& c,
               const GenerationTable& g, std::vector<CollectiveCost>& out) {
  const auto ch = static_cast<double>(c.channels());
  const int64_t steps = nccl_steps(kind, s.k);
  const double bw = c.nvlink_gbps() * g.nvls_efficiency * (ch - 1) / ch *
                    (kind == CollectiveKind::AllReduce ? 2.0 : (s.ppn - 1) / s.ppn);
  out.push_back(priced(CollectiveAlgorithm::Nvls, CollectiveProtocol::Simple,
                       kNvls.nvlink_latency_us[kSimple], bw * s.k / static_cast<double>(steps),
                       bytes, steps));
}

// All-to-all as concurrent pairwise sends: the node's share over NVLink, the rest over the
// network, in parallel.
CollectiveCost pairwise_cost(double bytes, const GroupShape& s, const ClusterSpec& c) {
  const double intra = bytes * (s.ppn - 1) / s.k / (c.nvlink_gbps() * 1e9);
  const double inter = bytes * (s.k - s.ppn) / s.k / (c.network_gbps() * 1e9);
  const double lat = kRing.base_latency_us[kSimple] +
                     (s.nodes > 1 ? kRing.network_latency_us : kRing.nvlink_latency_us)[kSimple];
  const double seconds = std::max(intra, inter);
  return priced(CollectiveAlgorithm::Pairwise, CollectiveProtocol::Simple, lat,
                seconds > 0 ? bytes / seconds / 1e9 : 0.0, bytes,
                nccl_steps(CollectiveKind::AllToAll, s.k));
}

// One transfer on its link; a receive costs its latency (the sender's time carries the bytes).
CollectiveCost p2p_cost(CollectiveKind kind, double bytes, const GroupShape& s,
                        const ClusterSpec& c) {
  const bool local = s.nodes == 1;
  const double lat = kRing.base_latency_us[kSimple] +
                     (local ? kRing.nvlink_latency_us : kRing.network_latency_us)[kSimple];
  const double gbps =
      kind == CollectiveKind::Recv ? 0.0 : (local ? c.nvlink_gbps() : c.network_gbps());
  return priced(CollectiveAlgorithm::PointToPoint, CollectiveProtocol::Simple, lat, gbps, bytes, 1);
}

} // namespace

std::string to_string(CollectiveAlgorithm a) {
  switch (a) {
  case CollectiveAlgorithm::Ring:
    return "ring";
  case CollectiveAlgorithm::Tree:
    return "tree";
  case CollectiveAlgorithm::Nvls:
    return "nvls";
  case CollectiveAlgorithm::NvlsTree:
    return "nvls_tree";
  case CollectiveAlgorithm::Pairwise:
    return "pairwise";
  case CollectiveAlgorithm::PointToPoint:
    return "p2p";
  }
  return "?";
}

std::string to_string(CollectiveProtocol p) {
  return p == CollectiveProtocol::LL ? "LL" : p == CollectiveProtocol::LL128 ? "LL128" : "Simple";
}

std::vector<CollectiveCost> collective_costs(CollectiveKind kind, int64_t bytes,
                                             const std::vector<int>& ranks,
                                             const ClusterSpec& cluster) {
  DTENSOR_CHECK(cluster.gpus_per_node() > 0 && cluster.nvlink_gbps() > 0 &&
                    cluster.network_gbps() > 0 && cluster.channels() > 1 && bytes >= 0,
                "collective_costs: cluster '{}' needs positive gpus_per_node ({}), bandwidths "
                "({}, {} GB/s) and at least 2 channels ({}); bytes {}",
                cluster.name(), cluster.gpus_per_node(), cluster.nvlink_gbps(),
                cluster.network_gbps(), cluster.channels(), bytes);
  std::vector<CollectiveCost> out;
  if (ranks.size() <= 1 || kind == CollectiveKind::Barrier) {
    if (ranks.size() > 1) { // a barrier: an all-reduce of nothing
      return collective_costs(CollectiveKind::AllReduce, 0, ranks, cluster);
    }
    return out;
  }
  const GroupShape s = shape_of(ranks, cluster.gpus_per_node());
  const auto b = static_cast<double>(bytes);
  if (!cluster.nccl()) {
    out.push_back(gloo_cost(kind, b, s, cluster));
    return out;
  }
  const GenerationTable& g =
      cluster.generation() == GpuGeneration::Blackwell ? kBlackwell : kHopper;
  switch (kind) {
  case CollectiveKind::AllReduce:
    ring_costs(kind, b, s, cluster, g, out);
    tree_costs(b, s, cluster, g, out);
    if (cluster.nvls() && s.nodes == 1) {
      nvls_cost(kind, b, s, cluster, g, out);
    }
    break;
  case CollectiveKind::AllGather:
  case CollectiveKind::ReduceScatter:
    ring_costs(kind, b, s, cluster, g, out);
    if (cluster.nvls() && s.nodes == 1 && s.ppn <= 32) {
      nvls_cost(kind, b, s, cluster, g, out);
    }
    break;
  case CollectiveKind::Broadcast:
    ring_costs(kind, b, s, cluster, g, out);
    break;
  case CollectiveKind::AllToAll:
    out.push_back(pairwise_cost(b, s, cluster));
    break;
  case CollectiveKind::Send:
  case CollectiveKind::Recv:
    out.push_back(p2p_cost(kind, b, s, cluster));
    break;
  case CollectiveKind::Barrier:
    break;
  }
  return out;
}

CollectiveCost collective_cost(CollectiveKind kind, int64_t bytes, const std::vector<int>& ranks,
                               const ClusterSpec& cluster) {
  const std::vector<CollectiveCost> all = collective_costs(kind, bytes, ranks, cluster);
  if (all.empty()) {
    return CollectiveCost{};
  }
  return *std::min_element(all.begin(), all.end(),
                           [](const auto& a, const auto& b) { return a.seconds < b.seconds; });
}

} // namespace dtensor

namespace dtensor {

// [Note: the cluster table] Stated figures, not measurements of this project (except the CPU
// row): NVLink as NCCL's topology counts it (18 links a GPU, 20.6 GB/s each on Hopper, 40.1 on
// Blackwell: its per-link values), the network as one 400 Gb/s NIC per GPU at the 45 GB/s
// nccl-tests reach, NCCL's channel counts (16 on Hopper, 32 on Blackwell), dense bf16 peaks and
// device memory from the vendors' sheets. GB200 is an NVL72 rack: 72 GPUs on one NVLink
// domain. The CPU row is the build machine's Gloo over loopback (2 cores), fitted by
// bench/collective_cost.cpp (docs/benchmarks.md): 240 us a ring step, 0.95 GB/s.
ClusterSpec cluster_spec(const std::string& name) {
  const auto hopper = [](const std::string& n, double memory) {
    return ClusterSpec().name(n).memory_gib(memory);
  };
  const auto blackwell = [](const std::string& n, int64_t per_node, double tflops, double memory) {
    return ClusterSpec()
        .name(n)
        .generation(GpuGeneration::Blackwell)
        .gpus_per_node(per_node)
        .nvlink_gbps(18 * 40.1)
        .channels(32)
        .bf16_tflops(tflops)
        .memory_gib(memory);
  };
  if (name == "h100") {
    return hopper(name, 79.6);
  }
  if (name == "h200") {
    return hopper(name, 139.8);
  }
  if (name == "b200") {
    return blackwell(name, 8, 2250, 179);
  }
  if (name == "gb200") {
    return blackwell(name, 72, 2500, 185);
  }
  if (name == "cpu") {
    return ClusterSpec()
        .name(name)
        .generation(GpuGeneration::Cpu)
        .gpus_per_node(1 << 20)
        .nvlink_gbps(0.95)
        .network_gbps(0.95)
        .nvls(false)
        .nccl(false)
        .step_latency_us(240)
        .bf16_tflops(0.05)
        .memory_gib(24);
  }
  DTENSOR_CHECK(false, "cluster_spec: no row '{}' (the rows: h100, h200, b200, gb200, cpu)", name);
  return {};
}

std::vector<std::string> cluster_names() {
  return {"h100", "h200", "b200", "gb200", "cpu"};
}

} // namespace dtensor
