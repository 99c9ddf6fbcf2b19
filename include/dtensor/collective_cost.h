#pragma once

// What a collective costs, by algorithm, as NCCL's tuner predicts it, on a cluster described by
// a row of a device / network table (docs/simulation.md, "Collectives by algorithm").
#include <cstdint>
#include <string>
#include <vector>

#include <torch/arg.h>

#include <dtensor/placement.h>
#include <dtensor/reduce_op.h>

namespace dtensor {

enum class CollectiveAlgorithm { Ring, Tree, Nvls, NvlsTree, Pairwise, PointToPoint };
enum class CollectiveProtocol { LL, LL128, Simple };
enum class GpuGeneration { Hopper, Blackwell, Cpu };

std::string to_string(CollectiveAlgorithm algorithm);
std::string to_string(CollectiveProtocol protocol);

// One row of the table: a node of GPUs on one NVLink domain and the network between nodes.
// Bandwidths are NCCL's bus bandwidth per GPU over all its channels (GB/s), as nccl-tests
// report it; `nccl` false (the CPU row): Gloo's ring with a measured latency per step.
struct ClusterSpec {
  TORCH_ARG(std::string, name) = "h100";
  TORCH_ARG(GpuGeneration, generation) = GpuGeneration::Hopper;
  TORCH_ARG(int64_t, gpus_per_node) = 8;  // ranks sharing one NVLink domain
  TORCH_ARG(double, nvlink_gbps) = 370.8; // 18 NVLink 4 links x 20.6 GB/s
  TORCH_ARG(double, network_gbps) = 45;   // a 400 Gb/s NIC per GPU, as achieved
  TORCH_ARG(int64_t, channels) = 16;      // NCCL's rings / trees in flight
  TORCH_ARG(bool, nvls) = true;           // NVLink SHARP (NVSwitch multicast)
  TORCH_ARG(double, bf16_tflops) = 989;   // dense peak
  TORCH_ARG(double, memory_gib) = 80;     // device memory
  TORCH_ARG(bool, nccl) = true;
  TORCH_ARG(double, step_latency_us) = 0; // the CPU row: Gloo's per ring step
};

// The table's rows by name: "h100", "h200", "b200", "gb200" (NVL72: 72 GPUs a domain), "cpu"
// (this project's 2-core build machine, Gloo over loopback, measured). Throws for others,
// naming the rows.
ClusterSpec cluster_spec(const std::string& name);
std::vector<std::string> cluster_names();

struct CollectiveCost {
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::Ring;
  CollectiveProtocol protocol = CollectiveProtocol::Simple;
  double seconds = 0;
  double latency_s = 0;      // the latency term
  double bandwidth_gbps = 0; // the algorithm bandwidth the bytes move at (bytes / (s - latency))
  int64_t steps = 0;         // the algorithm's steps (NCCL's nsteps)
};

// [Note: collectives by algorithm] NCCL's model for `kind` of `bytes` (NCCL's size: the whole
// buffer, i.e. all-gather's output and reduce-scatter's input) over the global ranks `ranks`
// (nodes of gpus_per_node consecutive ranks): every (algorithm, protocol) pair the cluster
// enables, each with its predicted time; empty for a group of one rank. See
// lib/sim/collective_cost.cpp.
std::vector<CollectiveCost> collective_costs(CollectiveKind kind, int64_t bytes,
                                             const std::vector<int>& ranks,
                                             const ClusterSpec& cluster);
// NCCL's choice: the cheapest of collective_costs (zero seconds for one rank).
CollectiveCost collective_cost(CollectiveKind kind, int64_t bytes, const std::vector<int>& ranks,
                               const ClusterSpec& cluster);

// [Note: redistribution costs are a metric] What changing one mesh dimension's placement costs
// for a tensor of `bytes` (its size over that dimension: the whole tensor on a 1-D mesh) over the
// dimension's `ranks`, on `cluster`: the cheapest path of direct transitions between
// Replicate, Partial and Shard(0 .. ndim - 1), each one collective or a local step (Replicate
// to Shard or Partial: a local chunk or zero fill, free; Shard to Replicate: all-gather;
// Partial to Replicate: all-reduce; Partial to Shard: reduce-scatter; Shard(i) to Shard(j):
// all-to-all of the local piece; Shard to Partial: through Replicate). A direct transition
// can cost more than a detour (on H100 a 1 KiB Shard(0) -> Shard(1) all-to-all costs more
// than an LL ring's all-gather then a free chunk), and a cost function of direct transitions
// alone, as PyTorch's redistribute_cost, then breaks the triangle inequality; as shortest
// paths the costs satisfy cost(a, c) <= cost(a, b) + cost(b, c) for every b, and `path` says
// which placements the cheapest way passes through ({from, ..., to}).
struct RedistributeCost {
  double seconds = 0;
  std::vector<Placement> path;
};
RedistributeCost redistribute_cost(const Placement& from, const Placement& to, int64_t ndim,
                                   int64_t bytes, const std::vector<int>& ranks,
                                   const ClusterSpec& cluster);
// One direct transition's seconds (infinity where there is none: Shard to Partial).
double direct_redistribute_seconds(const Placement& from, const Placement& to, int64_t bytes,
                                   const std::vector<int>& ranks, const ClusterSpec& cluster);

} // namespace dtensor
