// A program built against an installed dtensor only (test/consumer/check.sh builds it with
// CMake's find_package(dtensor) and with pkg-config, and runs it on 1 and 2 ranks). It guards
// what a user of the installation needs: the public headers and the models' (included as the
// examples include them) compile from the prefix, the library links and loads from it, and
// a DTensor product and a fully_shard model equal the plain product and model.
#include <iostream>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <dtensor/all.h>

#include <models/common_dtensor.h>
#include <models/fsdp_models.h>
#include <models/llama3.h>
#include <models/mlp_models.h>
#include <models/moe/float8.h>
#include <models/moe/load_balance.h>
#include <models/moe/parallelize.h>

namespace {

bool check(bool ok, const char* what) {
  if (!ok) {
    std::cerr << "consumer: rank " << dtensor::get_rank() << ": " << what << " differs\n";
  }
  return ok;
}

} // namespace

int main() {
  try {
    dtensor::init_process_group();
    const int world = dtensor::get_world_size();
    auto mesh = dtensor::init_device_mesh(c10::kCPU, {world}, {"dp"});
    bool ok = true;

    // Rows sharded over the ranks times a replicated matrix: rows stay sharded, and the full
    // tensor (one all-gather) is the plain product.
    at::manual_seed(0);
    at::Tensor a = at::randn({8, 6});
    at::Tensor b = at::randn({6, 4});
    dtensor::CommDebugMode mode;
    dtensor::DTensor c(at::mm(dtensor::distribute_tensor(a, mesh, {dtensor::Shard(0)}),
                              dtensor::distribute_tensor(b, mesh, {dtensor::Replicate()})));
    ok &= check(c.placements()[0].is_shard(0), "the product's placement");
    ok &= check(at::allclose(c.full_tensor(), at::mm(a, b), 1e-5, 1e-6), "the DTensor product");
    ok &= check(mode.count("dp", dtensor::CollectiveKind::AllGather) == (world > 1 ? 1 : 0),
                "the all-gather count");

    // A small Llama 3 from the installed models, fully sharded over the ranks, against the
    // same model unsharded: the same logits.
    auto args = dtensor::models::Llama3Args()
                    .dim(32)
                    .n_layers(2)
                    .n_heads(4)
                    .n_kv_heads(2)
                    .vocab_size(64)
                    .multiple_of(16)
                    .max_seq_len(16);
    auto build = [&] {
      at::manual_seed(1);
      dtensor::models::Llama3 m(args);
      m->init_weights();
      return m;
    };
    auto plain = build();
    auto sharded = build();
    dtensor::fully_shard(*sharded, dtensor::FullyShardOptions().mesh(mesh));
    at::Tensor tokens = at::arange(16, at::kLong).remainder(64).reshape({2, 8});
    torch::NoGradGuard no_grad;
    ok &= check(at::allclose(sharded->forward(tokens), plain->forward(tokens), 1e-5, 1e-5),
                "the fully_shard Llama 3's logits");

    dtensor::barrier(dtensor::world_group());
    if (ok && dtensor::get_rank() == 0) {
      std::cout << "consumer: " << world << " rank(s) ok\n";
    }
    dtensor::destroy_process_group();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "consumer failed: " << e.what() << "\n";
    return 1;
  }
}
