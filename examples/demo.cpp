// The demo: a (dp=2, tp=2) mesh on 4 ranks, a DTensor product and its redistributions,
// collectives on each dimension, and CommDebugMode's tables: a first look at the API (the
// main job, scripts/demo.sh, runs examples/train). Run it on 4 ranks:
//   torchrun --standalone --nproc-per-node 4 --no-python build/examples/demo
// `scripts/test.sh` runs it too (test `demo-w4`).
#include <iostream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dtensor/all.h>

int main() {
  try {
    at::set_num_threads(1);
    dtensor::init_process_group();
    const int world = dtensor::get_world_size();
    const int rank = dtensor::get_rank();
    // 2x2 on 4 ranks; any other world becomes (world/2, 2) or (1, world).
    std::vector<int64_t> shape = world % 2 == 0 ? std::vector<int64_t>{world / 2, 2}
                                                : std::vector<int64_t>{1, world};
    auto mesh = dtensor::init_device_mesh(c10::kCPU, shape, {"dp", "tp"});
    auto coord = *mesh.get_coordinate();

    dtensor::CommDebugMode mode;
    // tp: a row-parallel partial sum becomes replicated (all-reduce over tp).
    auto partial = at::full({4}, static_cast<double>(rank + 1), at::kFloat);
    dtensor::all_reduce_(partial, dtensor::ReduceOp::Sum, mesh.get_group("tp"));
    // dp: gather every dp shard, then reduce-scatter a gradient-sized tensor back to shards.
    auto shard = at::full({2}, static_cast<double>(coord[0]), at::kFloat);
    auto full = dtensor::all_gather_tensor(shard, 0, mesh.get_group("dp"));
    auto grad = at::ones({2 * mesh.size(0)}, at::kFloat) * (rank + 1);
    auto grad_shard = dtensor::reduce_scatter_tensor(grad, dtensor::ReduceOp::Avg, 0, mesh.get_group("dp"));
    // all dims: a scalar norm, one all-reduce per mesh dimension.
    auto norm_sq = at::full({1}, 1.0, at::kFloat);
    for (int64_t d = 0; d < mesh.ndim(); ++d) {
      dtensor::all_reduce_(norm_sq, dtensor::ReduceOp::Sum, mesh.get_group(d));
    }

    if (rank == 0) {
      std::cout << mesh.to_string() << "\n"
                << "tp all_reduce -> " << partial[0].item<float>() << ", dp all_gather -> "
                << full.sizes() << ", dp reduce_scatter(avg) -> " << grad_shard[0].item<float>()
                << ", norm^2 over " << mesh.ndim() << " dims -> " << norm_sq.item<float>()
                << " (world " << world << ")\n\n"
                << mode.table();
    }
    {
      // DTensor: a (Shard(0), Shard(1)) matrix, a product that leaves a Partial over tp, and
      // the redistributions that make things whole again.
      dtensor::CommDebugMode dt_mode;
      at::manual_seed(0);
      at::Tensor a_full = at::randn({8, 8});
      at::Tensor b_full = at::randn({8, 4});
      dtensor::DTensor a = dtensor::distribute_tensor(a_full, mesh, {dtensor::Shard(0), dtensor::Shard(1)});
      dtensor::DTensor b = dtensor::distribute_tensor(b_full, mesh, {dtensor::Replicate(), dtensor::Shard(0)});
      dtensor::DTensor c(at::mm(a, b)); // rows sharded over dp, partial sums over tp
      at::Tensor c_full = c.full_tensor();
      bool exact = at::allclose(c_full, at::mm(a_full, b_full), 1e-5, 1e-6);

      if (rank == 0) {
        std::cout << "\nDTensor mm: " << dtensor::to_string(a.placements()) << " x "
                  << dtensor::to_string(b.placements()) << " -> " << dtensor::to_string(c.placements())
                  << ", full_tensor equals the plain product: " << (exact ? "yes" : "NO") << "\n"
                  << dt_mode.table();
      }
    }
    dtensor::barrier(dtensor::world_group());
    dtensor::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "demo failed: " << e.what() << "\n";
    return 1;
  }
}
