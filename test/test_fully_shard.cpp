// fully_shard: parity with replicate (DDP) on common_fsdp.py's models, PyTorch's collective
// counts, memory after forward, HSDP, gradient accumulation, mixed precision, state dicts
// and errors.
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"
#include <models/mlp_models.h>

using dtensor::FSDPModule;

namespace {

constexpr int64_t kDim = 5; // MLPStack widths 15 and 20: uneven over 2 and 4 ranks

at::Tensor batch(int r, int step, at::ScalarType dtype = at::kFloat) {
  at::manual_seed(2000 + 31 * step + r);
  return at::randn({4, kDim}, options()).to(dtype);
}

// MLPStack with its LayerNorm (root parameters): each MLP a unit, the Sequential the root.
struct Sharded {
  torch::nn::Sequential model;
  std::vector<FSDPModule> blocks;
  FSDPModule root;
};

Sharded sharded_mlp_stack(const FullyShardOptions& opts) {
  torch::manual_seed(0);
  Sharded s{dtensor::models::mlp_stack(kDim, /*with_seq_parallel=*/true), {}, {}};
  s.model->to(options().device());
  for (size_t i = 0; i < 3; ++i) {
    s.blocks.push_back(dtensor::fully_shard(*s.model[i], opts));
  }
  s.root = dtensor::fully_shard(*s.model, opts);
  return s;
}

// The reference: the same model under replicate (DDP). Keep the handle while training.
struct Replicated {
  torch::nn::Sequential model;
  dtensor::ReplicateHandle handle;
  torch::nn::Sequential& operator*() { return model; }
  torch::nn::SequentialImpl* operator->() { return model.get(); }
};

Replicated replicated_mlp_stack(const DeviceMesh& dp) {
  torch::manual_seed(0);
  Replicated r{dtensor::models::mlp_stack(kDim, true), {}};
  r.model->to(options().device());
  r.handle = dtensor::replicate(*r.model, dp);
  return r;
}

void require_same_params(torch::nn::Module& a, torch::nn::Module& b, double rtol = 1e-5,
                         double atol = 1e-6) {
  auto p = a.parameters();
  auto q = b.parameters();
  REQUIRE(p.size() == q.size());
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(close(full_value(p[i]), q[i], rtol, atol));
  }
}

at::Tensor loss_of(torch::nn::Sequential& m, const at::Tensor& x) {
  return m->forward(x).pow(2).sum();
}

} // namespace

TEST_CASE("fully_shard: MLPStack matches replicate, with PyTorch's collective counts",
          "[fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  for (bool reshard_after_forward : {true, false}) {
    INFO("reshard_after_forward " << reshard_after_forward);
    auto ref = replicated_mlp_stack(dp);
    // An optimizer made before fully_shard keeps working: parameters convert in place.
    torch::manual_seed(0);
    auto model = dtensor::models::mlp_stack(kDim, true);
    model->to(options().device());
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<FSDPModule> blocks;
    auto opts = FullyShardOptions().mesh(dp).reshard_after_forward(reshard_after_forward);
    for (size_t i = 0; i < 3; ++i) {
      blocks.push_back(dtensor::fully_shard(*model[i], opts));
    }
    auto root = dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
    REQUIRE(root.is_root());
    REQUIRE_FALSE(blocks[0].is_root());
    REQUIRE(DTensor(model->parameters()[0]).placements() == dtensor::Placements{dtensor::Shard(0)});
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const int64_t k = 3;
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      at::Tensor loss;
      {
        CommDebugMode fwd;
        loss = loss_of(model, batch(rank(), step));
        REQUIRE(fwd.count(CollectiveKind::AllGather) == over(world(), k + 1));
        REQUIRE(fwd.total_count() == over(world(), k + 1));
      }
      // Memory: the blocks' unsharded parameters are freed after forward, the root's kept.
      for (auto& b : blocks) {
        REQUIRE((b.unsharded_storage_bytes() == 0) == (reshard_after_forward || world() == 1));
      }
      REQUIRE((root.unsharded_storage_bytes() > 0) == (world() > 1)); // one rank: aliased
      {
        CommDebugMode bwd;
        loss.backward();
        REQUIRE(bwd.count(CollectiveKind::AllGather) == over(world(), reshard_after_forward ? k : 0));
        REQUIRE(bwd.count(CollectiveKind::ReduceScatter) == over(world(), k + 1));
        REQUIRE(bwd.count(CollectiveKind::AllReduce) == 0);
      }
      for (auto& b : blocks) {
        REQUIRE(b.unsharded_storage_bytes() == 0);
      }
      REQUIRE(root.unsharded_storage_bytes() == 0);
      auto ref_loss = loss_of(*ref, batch(rank(), step));
      ref_loss.backward();
      REQUIRE(close(loss, ref_loss));
      auto p = model->parameters();
      auto q = ref->parameters();
      for (size_t i = 0; i < p.size(); ++i) {
        INFO("grad " << i);
        REQUIRE(DTensor(p[i].grad()).placements() == dtensor::Placements{dtensor::Shard(0)});
        REQUIRE(close(full_value(p[i].grad()), q[i].grad()));
      }
      opt.step();
      ref_opt.step();
      require_same_params(*model, **ref);
    }
  }
}

TEST_CASE("fully_shard: HSDP on a (replicate, shard) mesh matches replicate",
          "[fully_shard][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto hsdp = init_device_mesh(device_type(), {2, world() / 2}, {"replicate", "shard"});
  auto ref = replicated_mlp_stack(dp);
  auto s = sharded_mlp_stack(FullyShardOptions().mesh(hsdp));
  REQUIRE(DTensor(s.model->parameters()[0]).placements() ==
          dtensor::Placements{dtensor::Replicate(), dtensor::Shard(0)});
  torch::optim::SGD opt(s.model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    CommDebugMode mode;
    auto loss = loss_of(s.model, batch(rank(), step));
    loss.backward();
    // One reduce-scatter over "shard" and one all-reduce over "replicate" per unit.
    REQUIRE(mode.count("shard", CollectiveKind::ReduceScatter) == over(hsdp.size(1), 4));
    REQUIRE(mode.count("replicate", CollectiveKind::AllReduce) == 4);
    REQUIRE(mode.count(CollectiveKind::AllGather) == over(hsdp.size(1), 4 + 3));
    auto ref_loss = loss_of(*ref, batch(rank(), step));
    ref_loss.backward();
    REQUIRE(close(loss, ref_loss));
    opt.step();
    ref_opt.step();
    require_same_params(*s.model, **ref);
  }
}

// What [Note: one-rank shard groups alias] (lib/parallel/fsdp/param_group.cpp) promises:
// over a shard group of one rank no all-gather or reduce-scatter is issued (as PyTorch's
// FSDP2), HSDP's all-reduce still is (over one replica too, as FSDP2's), and no unit ever
// holds an unsharded copy: the only buffer is one unit's flat gradient at a time. With a cast
// (bf16 parameters) the unit holds its cast copy, still without a collective. Values:
// replicate (DDP) as the judge.
TEST_CASE("fully_shard: a shard group of one rank aliases the shard and issues nothing over it",
          "[fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto hsdp = init_device_mesh(device_type(), {world(), 1}, {"replicate", "shard"});
  auto ref = replicated_mlp_stack(dp);
  auto s = sharded_mlp_stack(FullyShardOptions().mesh(hsdp));
  int64_t largest_unit = 0; // bytes of the largest unit's parameters (the blocks')
  for (size_t i = 0; i < 3; ++i) {
    int64_t bytes = 0;
    for (const auto& p : s.model[i]->parameters()) {
      bytes += p.numel() * static_cast<int64_t>(p.element_size());
    }
    largest_unit = std::max(largest_unit, bytes);
  }
  torch::optim::SGD opt(s.model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    dtensor::reset_fsdp_peak_memory();
    CommDebugMode mode;
    auto loss = loss_of(s.model, batch(rank(), step));
    REQUIRE(s.root.is_unsharded());
    REQUIRE(s.root.unsharded_storage_bytes() == 0);
    loss.backward();
    REQUIRE(mode.count(CollectiveKind::AllGather) == 0);
    REQUIRE(mode.count(CollectiveKind::ReduceScatter) == 0);
    REQUIRE(mode.count("replicate", CollectiveKind::AllReduce) == 4); // also on one rank
    REQUIRE(mode.total_count() == 4);
    const dtensor::FSDPMemoryStats stats = dtensor::fsdp_memory_stats();
    REQUIRE(stats.unsharded_bytes == 0);
    REQUIRE(stats.peak_bytes == largest_unit);
    auto ref_loss = loss_of(*ref, batch(rank(), step));
    ref_loss.backward();
    REQUIRE(close(loss, ref_loss));
    opt.step();
    ref_opt.step();
    require_same_params(*s.model, **ref);
  }
  auto mp = dtensor::MixedPrecisionPolicy().param_dtype(at::kBFloat16);
  auto cast = sharded_mlp_stack(FullyShardOptions().mesh(hsdp).mp_policy(mp));
  CommDebugMode mode;
  cast.blocks[0].unshard();
  REQUIRE(mode.total_count() == 0);
  int64_t first_numel = 0;
  for (const auto& p : cast.model[0]->parameters()) {
    first_numel += p.numel();
  }
  REQUIRE(cast.blocks[0].unsharded_storage_bytes() == 2 * first_numel); // its bf16 copy
  cast.blocks[0].reshard();
  REQUIRE(cast.blocks[0].unsharded_storage_bytes() == 0);
}

TEST_CASE("fully_shard: gradient accumulation without sync, and keeping parameters unsharded",
          "[fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto ref = replicated_mlp_stack(dp);
  auto s = sharded_mlp_stack(FullyShardOptions().mesh(dp));
  s.root.set_requires_gradient_sync(false); // recurses into the blocks
  s.root.set_reshard_after_backward(false);
  {
    CommDebugMode mode;
    loss_of(s.model, batch(rank(), 0)).backward();
    REQUIRE(mode.count(CollectiveKind::ReduceScatter) == 0);
    REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 4 + 3));
  }
  REQUIRE(s.root.is_unsharded());
  REQUIRE_FALSE(s.model->parameters()[0].grad().defined()); // kept unsharded inside the unit
  s.root.set_requires_gradient_sync(true);
  {
    CommDebugMode mode;
    loss_of(s.model, batch(rank(), 1)).backward();
    // Everything was still unsharded: no all-gather in forward; the blocks reshard after
    // forward as usual and are gathered again in backward.
    REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 3));
    REQUIRE(mode.count(CollectiveKind::ReduceScatter) == over(world(), 4));
  }
  loss_of(*ref, batch(rank(), 0)).backward();
  loss_of(*ref, batch(rank(), 1)).backward();
  auto p = s.model->parameters();
  auto q = ref->parameters();
  for (size_t i = 0; i < p.size(); ++i) {
    REQUIRE(close(full_value(p[i].grad()), q[i].grad()));
  }
}

TEST_CASE("fully_shard: explicit unshard and reshard", "[fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto s = sharded_mlp_stack(FullyShardOptions().mesh(dp));
  REQUIRE_FALSE(s.blocks[0].is_unsharded());
  {
    CommDebugMode mode;
    s.blocks[0].unshard();
    REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 1));
  }
  REQUIRE(s.blocks[0].is_unsharded());
  REQUIRE((s.blocks[0].unsharded_storage_bytes() > 0) == (world() > 1));
  {
    torch::NoGradGuard no_grad;
    CommDebugMode mode;
    s.model->forward(batch(rank(), 0)); // block 0 is already unsharded
    REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 3));
  }
  s.root.reshard();
  REQUIRE(s.root.unsharded_storage_bytes() == 0);
}

namespace {

// x * w, whose backward uses the weight with a float32 tensor, as CUDA's layer norm backward
// takes its float32 mean and rstd with a bfloat16 weight.
struct ScaleFn : torch::autograd::Function<ScaleFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor stats = g[0].to(at::kFloat); // float32, like a saved statistic
    return {(stats * saved[1]).to(saved[0].scalar_type()), (g[0] * saved[0]).sum(0)};
  }
};

struct ScaleImpl : torch::nn::Module {
  ScaleImpl() : w(register_parameter("w", at::full({kDim}, 2.0))) {}
  at::Tensor forward(const at::Tensor& x) { return ScaleFn::apply(x, w); }
  at::Tensor w;
};
TORCH_MODULE(Scale);

} // namespace

TEST_CASE("fully_shard: param_dtype checks forward inputs, not backward's own arguments",
          "[fully_shard][world1][world2][world4]") {
  // Found on a GPU (docs/testing.md): CUDA's native_layer_norm_backward got float32 mean and
  // rstd beside the bfloat16 weight and was refused as a forward input in the wrong dtype.
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto mp = dtensor::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
  Scale m;
  dtensor::fully_shard(*m, FullyShardOptions().mesh(dp).mp_policy(mp));
  const at::Tensor x = batch(0, 0, at::kBFloat16); // the same batch on every rank
  REQUIRE_THROWS_WITH(m->forward(x.to(at::kFloat)), contains("runs in mp_policy.param_dtype"));
  m->forward(x).to(at::kFloat).sum().backward();
  // Every rank's gradient is sum(x) over the batch; averaged over the ranks, the same.
  REQUIRE(close(full_value(m->w.grad()), x.to(at::kFloat).sum(0), 1e-2, 1e-2));
}

TEST_CASE("fully_shard: mixed precision (bf16 parameters, fp32 reduction) matches its definition",
          "[fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto mp = dtensor::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
  auto s = sharded_mlp_stack(FullyShardOptions().mesh(dp).mp_policy(mp));
  // The reference, in one process: fp32 master weights; each step a bf16 copy computes every
  // rank's gradients, which are summed in fp32 and averaged.
  torch::manual_seed(0);
  auto master = dtensor::models::mlp_stack(kDim, true);
  master->to(options().device());
  auto low = dtensor::models::mlp_stack(kDim, true);
  low->to(options().device());
  low->to(at::kBFloat16);
  auto loss_fn = [](torch::nn::Sequential& m, const at::Tensor& x) {
    return m->forward(x).to(at::kFloat).pow(2).sum();
  };
  torch::optim::SGD opt(s.model->parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::SGD ref_opt(master->parameters(), torch::optim::SGDOptions(0.05));
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto out = s.model->forward(batch(rank(), step, at::kBFloat16));
    REQUIRE(out.scalar_type() == at::kBFloat16);
    auto loss = out.to(at::kFloat).pow(2).sum();
    loss.backward();

    ref_opt.zero_grad();
    auto mp_params = master->parameters();
    auto lp = low->parameters();
    std::vector<at::Tensor> sums;
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < lp.size(); ++i) {
        lp[i].copy_(mp_params[i]);
        sums.push_back(at::zeros_like(mp_params[i]));
      }
    }
    at::Tensor ref_loss;
    for (int r = 0; r < world(); ++r) {
      low->zero_grad();
      auto l = loss_fn(low, batch(r, step, at::kBFloat16));
      l.backward();
      if (r == rank()) {
        ref_loss = l;
      }
      for (size_t i = 0; i < lp.size(); ++i) {
        sums[i] += lp[i].grad().to(at::kFloat);
      }
    }
    REQUIRE(close(loss, ref_loss));
    for (size_t i = 0; i < lp.size(); ++i) {
      mp_params[i].mutable_grad() = sums[i] / world();
    }
    auto p = s.model->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("grad " << i);
      REQUIRE(p[i].scalar_type() == at::kFloat);
      REQUIRE(p[i].grad().scalar_type() ==
              at::kFloat); // reduced in fp32, stored in the param dtype
      REQUIRE(close(full_value(p[i].grad()), mp_params[i].grad(), 1e-4, 1e-5));
    }
    opt.step();
    ref_opt.step();
    require_same_params(*s.model, *master, 1e-4, 1e-5);
  }
  // Floating inputs in another dtype are refused with both dtypes named.
  REQUIRE_THROWS_WITH(s.model->forward(batch(rank(), 0)),
                      contains("mp_policy.param_dtype BFloat16"));
}

TEST_CASE("fully_shard: sharded and full state dicts restore training exactly",
          "[fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto ref = replicated_mlp_stack(dp);
  auto s = sharded_mlp_stack(FullyShardOptions().mesh(dp));
  torch::optim::SGD opt(s.model->parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05));
  auto train = [&](int step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    loss_of(s.model, batch(rank(), step)).backward();
    loss_of(*ref, batch(rank(), step)).backward();
    opt.step();
    ref_opt.step();
  };
  train(0);
  for (bool full_sd : {false, true}) {
    INFO("full_state_dict " << full_sd);
    auto sd_opts = dtensor::StateDictOptions().full_state_dict(full_sd);
    dtensor::StateDict saved;
    for (const auto& item : dtensor::get_model_state_dict(*s.model, sd_opts)) {
      saved.insert(item.key(), item.value().clone());
      REQUIRE(dtensor::is_dtensor(item.value()) == !full_sd);
    }
    for (auto& p : s.model->parameters()) {
      torch::NoGradGuard no_grad;
      p.zero_();
    }
    REQUIRE_FALSE(close(full_value(s.model->parameters()[0]), ref->parameters()[0]));
    dtensor::set_model_state_dict(*s.model, saved, sd_opts);
    require_same_params(*s.model, **ref);
    train(1 + (full_sd ? 1 : 0));
    require_same_params(*s.model, **ref);
  }
  // Full state dict on rank 0 only, broadcast on load.
  auto r0 = dtensor::get_model_state_dict(
      *s.model, dtensor::StateDictOptions().full_state_dict(true).cpu_offload(true));
  REQUIRE(r0.size() == (rank() == 0 ? s.model->parameters().size() : 0));
  dtensor::StateDict saved;
  for (const auto& item : r0) {
    saved.insert(item.key(), item.value().clone());
  }
  for (auto& p : s.model->parameters()) {
    torch::NoGradGuard no_grad;
    p.zero_();
  }
  dtensor::set_model_state_dict(*s.model, saved,
                                dtensor::StateDictOptions().broadcast_from_rank0(true));
  require_same_params(*s.model, **ref);
  dtensor::StateDict bad;
  bad.insert("no.such.weight", at::zeros({1}));
  REQUIRE_THROWS_WITH(dtensor::set_model_state_dict(*s.model, bad),
                      contains("'no.such.weight' is not a parameter"));
}

TEST_CASE("fully_shard: errors", "[fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto opts = FullyShardOptions().mesh(dp);
  {
    torch::nn::Sequential m(torch::nn::Linear(4, 4));
    dtensor::fully_shard(*m, opts);
    REQUIRE_THROWS_WITH(dtensor::fully_shard(*m, opts), contains("is already fully sharded"));
  }
  {
    // A layer inside a unit and registered again directly in the parent.
    torch::nn::Linear a(4, 4);
    auto inner = std::make_shared<torch::nn::Module>();
    inner->register_module("0", a.ptr());
    auto outer = std::make_shared<torch::nn::Module>();
    outer->register_module("0", inner);
    outer->register_module("1", a.ptr());
    dtensor::fully_shard(*inner, opts);
    REQUIRE_THROWS_WITH(dtensor::fully_shard(*outer, opts),
                        contains("'1.weight' is shared with '0.0.weight'"));
  }
  if (world() > 1) {
    auto fn = [](const at::Tensor& p) -> std::optional<dtensor::Placement> {
      return p.dim() == 2 ? std::optional<dtensor::Placement>(dtensor::Shard(1)) : std::nullopt;
    };
    torch::nn::Linear odd(3, 4); // weight [4, 3]: 3 columns over 2 or 4 ranks
    REQUIRE_THROWS_WITH(
        dtensor::fully_shard(*odd, FullyShardOptions().mesh(dp).shard_placement_fn(fn)),
        contains("sharded unevenly on dim 1"));
  }
  {
    // A meta parameter is taken (docs/meta_init.md): sharded without memory until to_empty.
    auto m = std::make_shared<torch::nn::Module>();
    m->register_parameter("w", at::empty({4, 4}, at::kMeta));
    dtensor::fully_shard(*m, opts);
    REQUIRE(m->named_parameters()["w"].is_meta());
    dtensor::to_empty(*m, options().device());
    const DTensor w(m->named_parameters()["w"]);
    REQUIRE(w.to_local().device() == options().device());
    REQUIRE(w.to_local().sizes() == w.spec().local_shape());
  }
}

TEST_CASE("fully_shard: prefetch lists keep the counts and gather ahead",
          "[fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto s = sharded_mlp_stack(FullyShardOptions().mesh(dp));
  s.blocks[0].set_modules_to_forward_prefetch({s.blocks[1], s.blocks[2]});
  s.blocks[2].set_modules_to_backward_prefetch({s.blocks[1], s.blocks[0]});
  CommDebugMode mode;
  {
    torch::NoGradGuard no_grad;
    // The first op on block 0 gathers it and, right after, blocks 1 and 2.
    s.model[0]->as<dtensor::models::MLPImpl>()->in_proj->forward(batch(rank(), 0));
    REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 3));
    REQUIRE(s.blocks[1].is_unsharded());
    REQUIRE(s.blocks[2].is_unsharded());
  }
  mode.reset();
  auto loss = loss_of(s.model, batch(rank(), 0)); // only the root is left to gather
  REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 1));
  mode.reset();
  loss.backward(); // block 2's refill brings blocks 1 and 0 along
  REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 3));
  REQUIRE(mode.count(CollectiveKind::ReduceScatter) == over(world(), 4));
}

TEST_CASE("fully_shard: gradient divide factor, offload policy and ignored parameters",
          "[fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto base = sharded_mlp_stack(FullyShardOptions().mesh(dp));
  loss_of(base.model, batch(rank(), 0)).backward();
  {
    // Summed instead of averaged gradients.
    auto s = sharded_mlp_stack(FullyShardOptions().mesh(dp));
    for (auto& b : s.blocks) {
      b.set_gradient_divide_factor(1.0);
    }
    s.root.set_gradient_divide_factor(1.0);
    loss_of(s.model, batch(rank(), 0)).backward();
    for (size_t i = 0; i < s.model->parameters().size(); ++i) {
      REQUIRE(close(full_value(s.model->parameters()[i].grad()),
                    full_value(base.model->parameters()[i].grad()) * world()));
    }
  }
  {
    // Offloading to the CPU: accepted, same training, everything sharded stays on the CPU.
    auto s = sharded_mlp_stack(
        FullyShardOptions().mesh(dp).offload_policy(dtensor::OffloadPolicy().offload_to_cpu(true)));
    loss_of(s.model, batch(rank(), 0)).backward();
    for (size_t i = 0; i < s.model->parameters().size(); ++i) {
      auto g = s.model->parameters()[i].grad();
      REQUIRE(DTensor(g).to_local().is_cpu());
      REQUIRE(close(full_value(g), full_value(base.model->parameters()[i].grad())));
    }
  }
  {
    // An ignored parameter stays a plain tensor with this rank's own gradient.
    torch::manual_seed(0);
    auto model = dtensor::models::mlp_stack(kDim, true);
    model->to(options().device());
    auto ln_weight = model[3]->as<torch::nn::LayerNormImpl>()->weight;
    dtensor::fully_shard(*model, FullyShardOptions().mesh(dp).ignored_params({ln_weight}));
    REQUIRE_FALSE(dtensor::is_dtensor(ln_weight));
    REQUIRE(dtensor::is_dtensor(model[3]->as<torch::nn::LayerNormImpl>()->bias));
    torch::manual_seed(0);
    auto local = dtensor::models::mlp_stack(kDim, true);
    local->to(options().device());
    loss_of(model, batch(rank(), 0)).backward();
    loss_of(local, batch(rank(), 0)).backward();
    REQUIRE(close(ln_weight.grad(), local[3]->as<torch::nn::LayerNormImpl>()->weight.grad()));
  }
}
