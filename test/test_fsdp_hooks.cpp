// Communication controls of fully_shard (PyTorch's test_fsdp_comm_hooks.py, per-parameter):
// the default reduction (gradient == mean over ranks), and FSDP2's all-reduce hook (custom
// HSDP on a 1-D unit, equal to native HSDP), with exact collective counts.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "support/prelude.h"

namespace {

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 4));
}

} // namespace

TEST_CASE("fully_shard / replicate: the default reduction is the mean over ranks (PyTorch's "
          "test_fsdp_comm_hooks.py)",
          "[fsdp_hooks][world1][world2][world4]") {
  // Linear(1, W, bias=false) with input = rank: d loss / d w = rank on every rank, so the
  // reduced gradient is the mean of the ranks, (W - 1) / 2, in every iteration.
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  const double mean = (world() - 1) / 2.0;
  for (const std::string mode : {"no_shard", "reshard", "keep_unsharded"}) {
    INFO(mode);
    torch::manual_seed(0);
    torch::nn::Linear lin(torch::nn::LinearOptions(1, world()).bias(false));
    lin->to(options().device());
    std::optional<dtensor::ReplicateHandle> ddp;
    if (mode == "no_shard") {
      ddp = dtensor::replicate(*lin, mesh);
    } else {
      dtensor::fully_shard(*lin,
                           FullyShardOptions().mesh(mesh).reshard_after_forward(mode == "reshard"));
    }
    for (int it = 0; it < 4; ++it) {
      lin->zero_grad();
      at::Tensor x = at::full({1, 1}, static_cast<double>(rank()), options());
      lin->forward(x).sum().backward();
      REQUIRE(close(full_value(lin->weight.grad()), at::full({world(), 1}, mean, options())));
    }
  }
}

TEST_CASE("fully_shard: custom HSDP through set_all_reduce_hook equals native HSDP",
          "[fsdp_hooks][world4]") {
  auto mesh = init_device_mesh(device_type(), {2, 2}, {"rep", "shard"});
  const dtensor::Group rep = mesh.get_group("rep");
  torch::manual_seed(0);
  auto native = mlp();
  native->to(options().device());
  torch::manual_seed(0);
  auto custom = mlp();
  custom->to(options().device());
  // Native HSDP: (rep, shard). Custom: 1-D over shard, the replicas averaged by the hook.
  std::vector<dtensor::FSDPModule> units;
  int hook_calls = 0;
  for (size_t i : {0, 2}) {
    dtensor::fully_shard(*native[i], FullyShardOptions().mesh(mesh));
    units.push_back(dtensor::fully_shard(*custom[i], FullyShardOptions().mesh(mesh["shard"])));
  }
  dtensor::fully_shard(*native, FullyShardOptions().mesh(mesh));
  units.push_back(dtensor::fully_shard(*custom, FullyShardOptions().mesh(mesh["shard"])));
  for (auto& unit : units) {
    unit.set_all_reduce_hook([&](at::Tensor& reduced) {
      ++hook_calls;
      dtensor::all_reduce_(reduced, dtensor::ReduceOp::Avg, rep);
    });
  }
  at::manual_seed(7 + rank()); // a different batch on every rank
  at::Tensor x = at::randn({5, 8}, options());
  native->forward(x).pow(2).sum().backward();
  int64_t rs = 0;
  int64_t ar = 0;
  {
    CommDebugMode m;
    custom->forward(x).pow(2).sum().backward();
    // Two Linear units (the root holds no parameter of its own): one reduce-scatter over
    // shard and one all-reduce over rep each, the latter issued by the hook.
    rs = m.count("shard", CollectiveKind::ReduceScatter);
    ar = m.count("rep", CollectiveKind::AllReduce);
  }
  REQUIRE(hook_calls == 2);
  REQUIRE(rs == 2);
  REQUIRE(ar == 2);
  // The plain model's gradient averaged over every rank's batch is what both must give.
  torch::manual_seed(0);
  auto plain = mlp();
  plain->to(options().device());
  plain->forward(x).pow(2).sum().backward();
  auto a = native->parameters();
  auto b = custom->parameters();
  auto c = plain->parameters();
  REQUIRE(a.size() == b.size());
  REQUIRE(a.size() == c.size());
  for (size_t k = 0; k < a.size(); ++k) {
    at::Tensor mean = c[k].grad().clone();
    dtensor::all_reduce_(mean, dtensor::ReduceOp::Avg, dtensor::world_group());
    REQUIRE(close(full_value(b[k].grad()), mean));
    REQUIRE(close(full_value(a[k].grad()), mean));
  }
  // Native HSDP: the hook runs after the built-in all-reduce, on the average.
  int native_hook = 0;
  dtensor::fsdp_module(*native[0])->set_all_reduce_hook([&](at::Tensor& g) {
    ++native_hook;
    g.mul_(2.0);
  });
  auto before = full_value(a[0].grad()).clone();
  native->zero_grad();
  native->forward(x).pow(2).sum().backward();
  REQUIRE(native_hook == 1);
  REQUIRE(close(full_value(native[0]->named_parameters()["weight"].grad()), before * 2));
}
