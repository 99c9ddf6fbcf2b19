#pragma once
// Expert parallelism: the experts of a mixture-of-experts layer sharded over the ranks of an
// `ep` mesh dimension, each token sent to the ranks holding its experts and back, after
// torchtitan's ExpertParallel (its AllToAllTokenDispatcher), on the module seam. Mechanism,
// counts and meshes: docs/moe.md.
//
//   ExpertParallel ep;
//   ep.apply(*moe->experts, ep_mesh);        // weights [E, ...] -> Shard(0); dispatch, combine
//   ep.apply_router(*moe->router, ep_mesh);  // optional: the count exchange starts early
//
// The experts module's forward(x [N, D], counts [E]) takes rows grouped by expert in expert
// order (counts[e] rows for expert e, int64) and returns one row per input row; it computes
// on its parameters' local shards (dtensor::local_map). Around each call the style
//  1. exchanges the counts (one all-to-all of E int64s),
//  2. sends each rank the rows of its experts (one all-to-all of variable splits) and orders
//     them expert-major, so that the module sees its E/ep experts' rows and counts [E/ep],
//  3. sends the results back to where the rows came from (the inverse all-to-all).
// Backward: the gradients of 2 and 3 go back by one all-to-all each. Per call: forward 3
// all-to-alls, backward 2. A rank with no rows, an expert with none, and every row to one
// expert are ordinary cases (empty splits; no padding).
//
// With ExpertParallelOptions().dispatch(EpDispatch::Capacity) the split sizes never reach
// the host ([Note: capacity dispatch] in lib/parallel/ep/capacity_dispatch.cpp): every rank
// sends every rank a buffer of C rows, C = ceil(capacity_factor * max_rows / ep) (at most
// max_rows), the counts carried in the buffer's first rows. The experts module then sees
// ep * C rows of which the first sum(counts) are grouped as above and the rest are padding
// whose outputs are ignored. Per call: forward 2 all-to-alls, backward 2. Rows beyond a
// destination's C are refused (EpOverflow::Refuse: checked at the end of the backward, or
// at the call without autograd, naming the layer, ranks, experts and rows) or dropped
// (EpOverflow::Drop: those (token, expert) pairs contribute nothing, as GShard's capacity).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <dtensor/device_mesh.h>
#include <dtensor/process_group.h>
#include <dtensor/tensor_parallel.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor {

// all_to_all_single (dtensor/collectives.h) with autograd: the gradient goes back by the
// inverse all-to-all (the splits swapped). PyTorch's all_to_all_single_autograd.
at::Tensor all_to_all_single_autograd(const at::Tensor& input,
                                      const std::vector<int64_t>& out_splits,
                                      const std::vector<int64_t>& in_splits, const Group& group);

// How the rows travel: Variable (the counts exchanged first and read by the host, every row
// sent, no padding) or Capacity (fixed buffers, nothing read by the host).
enum class EpDispatch { Variable, Capacity };
// What Capacity dispatch does with rows beyond a destination's capacity.
enum class EpOverflow { Refuse, Drop };

struct ExpertParallelOptions {
  TORCH_ARG(EpDispatch, dispatch) = EpDispatch::Variable;
  // Capacity: C = ceil(capacity_factor * max_rows / ep) rows per (source, destination) pair,
  // at most max_rows; capacity_factor >= ep never overflows.
  TORCH_ARG(double, capacity_factor) = 1.25;
  // Capacity: the most rows any rank sends in one call (the buffers' size is the same on every
  // rank); 0: the call's own rows, which every rank of the ep mesh must then have alike (a
  // training step's microbatches do).
  TORCH_ARG(int64_t, max_rows) = 0;
  TORCH_ARG(EpOverflow, overflow) = EpOverflow::Refuse;
  // Either dispatch: the rows cast to float8 e4m3 before the dispatch all-to-all, each with a
  // power-of-two fp32 scale of its own (torchao's rowwise cast), D + 4 bytes a row on the wire,
  // and back in their dtype on arrival. The combine and every gradient stay in the rows' dtype.
  TORCH_ARG(bool, float8_dispatch) = false;
  // Capacity dispatch: each call's rows travel in two chunks of the capacity slots, the experts
  // computing one chunk while the other's rows are in flight, in forward and in backward
  // ([Note: overlapped chunks] in lib/parallel/ep/expert_parallel.cpp). The same values; per
  // call 4 all-to-alls forward and 4 backward, of half the rows each.
  TORCH_ARG(bool, overlap) = false;
};

// What the style measured (this process, since the last reset_ep_stats()).
struct EpStats {
  int64_t calls = 0;           // experts calls dispatched
  int64_t early_exchanges = 0; // count exchanges started by the router hook, before the call
  int64_t rows_sent = 0;       // rows dispatched to other ranks and this one
  int64_t rows_received = 0;   // rows received for this rank's experts
  double wait_seconds = 0;     // time a call waited for its counts
  int64_t capacity_calls = 0;  // of the calls, those dispatched with capacity buffers
  int64_t rows_dropped = 0;    // (token, expert) rows beyond capacity dropped (EpOverflow::Drop)
};
// Capacity dispatch's device counts (received and dropped rows) are read here, not per call.
EpStats ep_stats();
void reset_ep_stats();

class ExpertParallel : public ParallelStyle {
 public:
  explicit ExpertParallel(ExpertParallelOptions options = {});
  const ExpertParallelOptions& options() const { return options_; }
  std::string name() const override { return "ExpertParallel"; }
  bool needs_module_calls() const override { return true; }
  // `experts`: every direct parameter [E, ...] becomes a Shard(0) DTensor on the 1-D ep_mesh
  // (E a multiple of its size; refused naming the parameter otherwise); its calls through
  // dtensor::call dispatch and combine as above.
  void apply(torch::nn::Module& experts, const DeviceMesh& ep_mesh) const override;
  // `router`: a module whose last output is the counts [E] (int64) that the experts call will
  // receive. The exchange of those counts starts, asynchronously, as its call returns: what
  // the model computes between the router and the experts (shared experts, the permutation)
  // overlaps it.
  void apply_router(torch::nn::Module& router, const DeviceMesh& ep_mesh) const;

  struct State; // the counts exchange in flight (lib/parallel/ep/expert_parallel.cpp)

 private:
  ExpertParallelOptions options_;
  std::shared_ptr<State> state_;
};

} // namespace dtensor
