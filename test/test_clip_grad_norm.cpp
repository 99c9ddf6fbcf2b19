// clip_grad_norm_ over DTensor gradients (PyTorch's test_fully_shard_clip_grad_norm_.py and
// test_fsdp_clip_grad_norm.py): the total norm equals the unsharded model's, costs exactly one
// all-reduce per mesh dimension, and clips the same.
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>

#include <c10/util/Exception.h>

#include <limits>

#include "support/prelude.h"
#include <models/fsdp_models.h>
#include <models/mlp_models.h>

using dtensor::testing::near;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double vector_norm(const at::Tensor& t, double p) {
  return at::linalg_vector_norm(t.to(at::kDouble), p).item<double>();
}

// One training step of `model` and `ref` with clipping, checking everything
// test_fully_shard_clip_grad_norm_.py checks.
template <typename M, typename R>
void clip_step(M& model, R& ref, torch::optim::Optimizer& opt, torch::optim::Optimizer& ref_opt,
               const std::function<at::Tensor(M&)>& loss_of,
               const std::function<at::Tensor(R&)>& ref_loss_of, double max_norm, double norm_type,
               int64_t mesh_dims) {
  opt.zero_grad();
  ref_opt.zero_grad();
  loss_of(model).backward();
  ref_loss_of(ref).backward();
  auto p = model->named_parameters();
  auto q = ref->named_parameters();
  std::vector<at::Tensor> before;
  bool some_above = false;
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("grad " << p[i].key());
    REQUIRE(near(full_value(p[i].value().grad()), q[i].value().grad()));
    before.push_back(full_value(p[i].value().grad()).clone());
    some_above = some_above || vector_norm(q[i].value().grad(), norm_type) > max_norm;
  }
  REQUIRE(some_above); // the clip is not vacuous
  const double ref_total =
      torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm, norm_type);
  at::Tensor total;
  {
    CommDebugMode mode;
    total = dtensor::clip_grad_norm_(model->parameters(), max_norm, norm_type);
    REQUIRE(dtensor::is_dtensor(total));
    REQUIRE(static_cast<int64_t>(DTensor(total).placements().size()) == mesh_dims);
    // One all-reduce per mesh dimension of more than one rank ([Note: one-rank mesh
    // dimensions communicate nothing]).
    const dtensor::DeviceMesh& mesh = DTensor(total).device_mesh();
    int64_t expected_all_reduces = 0;
    for (int64_t d = 0; d < mesh.ndim(); ++d) {
      expected_all_reduces += over(mesh.size(d), 1);
    }
    REQUIRE(mode.count(CollectiveKind::AllReduce) == expected_all_reduces);
    REQUIRE(mode.total_count() == expected_all_reduces);
  }
  REQUIRE(std::abs(DTensor(total).full_tensor().item<double>() - ref_total) <=
          1e-4 * std::max(1.0, ref_total));
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("clipped " << p[i].key());
    at::Tensor g = full_value(p[i].value().grad());
    REQUIRE(vector_norm(g, norm_type) <= max_norm * (1 + 1e-5));
    REQUIRE(near(g, q[i].value().grad()));
    if (before[i].count_nonzero().item<int64_t>() > 0) {
      REQUIRE_FALSE(at::equal(g, before[i]));
    }
  }
  opt.step();
  ref_opt.step();
}

} // namespace

TEST_CASE("clip_grad_norm_: 1-D fully_shard Transformer against replicate (PyTorch's "
          "test_fully_shard_clip_grad_norm_.py)",
          "[clip_grad_norm][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  using dtensor::models::Transformer;
  auto args = dtensor::models::ModelArgs().dropout_p(0.0);
  for (double norm_type : {2.0, 1.0, kInf}) {
    INFO("norm_type " << norm_type);
    torch::manual_seed(0);
    Transformer ref(args);
    ref->to(options().device());
    auto handle = dtensor::replicate(*ref, dp);
    torch::manual_seed(0);
    Transformer model(args);
    model->to(options().device());
    for (auto& layer : *model->layers) {
      dtensor::fully_shard(*layer, FullyShardOptions().mesh(dp));
    }
    auto root = dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.01));
    for (int iter = 0; iter < 10; ++iter) {
      INFO("iteration " << iter);
      at::manual_seed(42 + iter + 100 * rank());
      auto tokens = at::randint(8, {3, 16}, options(at::kLong));
      std::function<at::Tensor(Transformer&)> loss = [&](Transformer& m) {
        return m->forward(tokens).sum();
      };
      clip_step<Transformer, Transformer>(model, ref, opt, ref_opt, loss, loss, 1.0, norm_type, 1);
    }
    // The FSDPModule member: the same on the root, refused on a block.
    REQUIRE_THROWS_WITH(dtensor::fsdp_module(*model->layers[0])->clip_grad_norm_(1.0),
                        contains("should only be called on the root FSDP instance"));
    REQUIRE(root.clip_grad_norm_(1.0, norm_type).defined());
  }
}

TEST_CASE("clip_grad_norm_: 2-D FSDP x TP MLPStack against replicate (PyTorch's "
          "test_fully_shard_clip_grad_norm_.py)",
          "[clip_grad_norm][world1][world2][world4]") {
  const int64_t tp_size = world() >= 2 ? 2 : 1;
  auto mesh = init_device_mesh(device_type(), {world() / tp_size, tp_size}, {"dp", "tp"});
  auto dp = mesh["dp"];
  auto tp = mesh["tp"];
  for (double norm_type : {2.0, 1.0, 3.0, kInf}) {
    INFO("norm_type " << norm_type);
    torch::manual_seed(0);
    auto ref = dtensor::models::mlp_stack(16, true);
    ref->to(options().device());
    auto handle = dtensor::replicate(*ref, dp);
    torch::manual_seed(0);
    auto model = dtensor::models::mlp_stack(16, true);
    model->to(options().device());
    // Non-root units keep the default (reshard after forward).
    dtensor::testing::parallelize_mlp_stack(model, tp, dp, /*reshard_after_forward=*/true);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.01));
    for (int iter = 0; iter < 5; ++iter) {
      INFO("iteration " << iter);
      at::manual_seed(7 + iter + 100 * dp.get_local_rank(0)); // same input within a dp group
      auto x = at::randn({2, 8, 16}, options());
      // Squares: a plain sum of LayerNorm outputs has nearly flat gradients.
      std::function<at::Tensor(torch::nn::Sequential&)> loss = [&](torch::nn::Sequential& m) {
        at::Tensor out = m->forward(x).pow(2).sum();
        return dtensor::is_dtensor(out) ? DTensor(out).full_tensor() : out;
      };
      clip_step<torch::nn::Sequential, torch::nn::Sequential>(model, ref, opt, ref_opt, loss, loss,
                                                              0.5, norm_type, 2);
    }
  }
}

TEST_CASE("clip_grad_norm_: gradients on different meshes, one all-reduce per dimension",
          "[clip_grad_norm][world1][world2][world4]") {
  const int64_t tp_size = world() >= 2 ? 2 : 1;
  auto mesh = init_device_mesh(device_type(), {world() / tp_size, tp_size}, {"dp", "tp"});
  auto dp = mesh["dp"];
  torch::manual_seed(0);
  auto ref = dtensor::models::mlp_stack(16, true);
  ref->to(options().device());
  auto handle = dtensor::replicate(*ref, dp);
  torch::manual_seed(0);
  auto model = dtensor::models::mlp_stack(16, true);
  model->to(options().device());
  // Only the first MLP is tensor-parallel (its gradients on (tp, dp)); the others and the
  // LayerNorm are fully sharded over dp only.
  dtensor::parallelize_module(*model, mesh["tp"],
                              dtensor::ParallelizePlan{
                                  {"0.in_proj", dtensor::ColwiseParallel()},
                                  {"0.out_proj", dtensor::RowwiseParallel()},
                              });
  for (size_t i = 0; i < 3; ++i) {
    dtensor::fully_shard(*model[i], FullyShardOptions().mesh(dp));
  }
  dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.01));
  for (double norm_type : {2.0, kInf}) {
    at::manual_seed(11 + 100 * dp.get_local_rank(0));
    auto x = at::randn({2, 8, 16}, options());
    std::function<at::Tensor(torch::nn::Sequential&)> loss = [&](torch::nn::Sequential& m) {
      at::Tensor out = m->forward(x).pow(2).sum();
      return dtensor::is_dtensor(out) ? DTensor(out).full_tensor() : out;
    };
    clip_step<torch::nn::Sequential, torch::nn::Sequential>(model, ref, opt, ref_opt, loss, loss,
                                                            0.5, norm_type, 2);
  }
}

TEST_CASE("get_total_norm: a mesh without names beside another is named in the error; meshes "
          "that share no root each give their norm, combined",
          "[clip_grad_norm][world1][world2][world4]") {
  // Three meshes made by init_device_mesh: each is its own root.
  auto named = init_device_mesh(device_type(), {world()}, {"dp"});
  auto other = init_device_mesh(device_type(), {1, world()}, {"x", "y"});
  auto unnamed = init_device_mesh(device_type(), {world()});
  auto on = [](const dtensor::DeviceMesh& mesh) {
    return dtensor::distribute_tensor(at::ones({4}, options()), mesh,
                                      dtensor::Placements(mesh.ndim(), dtensor::Replicate()));
  };
  REQUIRE_THROWS_WITH(
      dtensor::get_total_norm({on(unnamed), on(named)}),
      contains("get_total_norm: gradients live on several meshes, and DeviceMesh(") &&
          contains("has no dimension names to place it on the root mesh"));
  // Different roots: each root's norm, combined ([Note: gradients on several roots]). Four
  // replicated ones on each: sqrt(4 + 4), no communication (nothing is sharded).
  const std::vector<at::Tensor> grads = {on(named), on(other)};
  CommDebugMode mode;
  const at::Tensor both = dtensor::get_total_norm(grads);
  REQUIRE(!dtensor::is_dtensor(both));
  REQUIRE(std::abs(both.item<double>() - std::sqrt(8.0)) <= 1e-6);
  REQUIRE(mode.total_count() == 0);
}

TEST_CASE("get_total_norm: gradients on two roots and a flattened mesh under a pipeline "
          "(torchtitan's _clip_grad_norm_with_ep): each one's all-reduce, then one over pp",
          "[clip_grad_norm][world4]") {
  // Two stages of two ranks: dense gradients on (pp, dp)'s dp, experts on another root's ep,
  // one more on dp flattened under a name of its own (as dp_shard x cp), each Shard(0).
  auto dense = init_device_mesh(device_type(), {2, 2}, {"pp", "dp"});
  auto sparse = init_device_mesh(device_type(), {2, 2}, {"pp", "ep"});
  auto flat = dense["dp"].flatten("dp_flat");
  // Stage s's whole gradient k: the same on its ranks, other values on the other stage.
  auto whole = [](int64_t s, int64_t k) {
    return at::arange(8, options()).add(static_cast<double>(10 * s + 3 * k)).sin();
  };
  const int64_t stage = dense.get_local_rank("pp");
  const std::vector<dtensor::DeviceMesh> meshes = {dense["dp"], sparse["ep"], flat};
  std::vector<at::Tensor> grads;
  for (size_t k = 0; k < meshes.size(); ++k) {
    grads.push_back(dtensor::distribute_tensor(whole(stage, static_cast<int64_t>(k)), meshes[k],
                                               {dtensor::Shard(0)}));
  }
  // The judge: the plain norm of every stage's whole gradients.
  std::vector<at::Tensor> all;
  for (int64_t s = 0; s < 2; ++s) {
    for (int64_t k = 0; k < 3; ++k) {
      all.push_back(whole(s, k));
    }
  }
  const at::Tensor flat_all = at::cat(all).abs();
  for (double p : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
    INFO("norm_type " << p);
    const double want = std::isinf(p) ? flat_all.max().item<double>()
                                      : flat_all.pow(p).sum().pow(1.0 / p).item<double>();
    CommDebugMode mode;
    const at::Tensor total = dtensor::get_total_norm(grads, p, false, dense["pp"]);
    REQUIRE(!dtensor::is_dtensor(total));
    REQUIRE(std::abs(total.item<double>() - want) <= 1e-5 * want);
    REQUIRE(mode.count(CollectiveKind::AllReduce) == 4);
    REQUIRE(mode.total_count() == 4);
  }
  // Stages that hold different roots (a stage without MoE layers): stage 0 the dense gradient
  // alone, stage 1 all three. Each stage's own all-reduces come first, pp's last, on both.
  std::vector<at::Tensor> some = stage == 0 ? std::vector<at::Tensor>{grads[0]} : grads;
  const at::Tensor kept =
      at::cat({whole(0, 0), whole(1, 0), whole(1, 1), whole(1, 2)}).abs().square().sum().sqrt();
  CommDebugMode mode;
  const at::Tensor total = dtensor::get_total_norm(some, 2.0, false, dense["pp"]);
  const double got = dtensor::is_dtensor(total) ? DTensor(total).to_local().item<double>()
                                                : total.item<double>();
  REQUIRE(std::abs(got - kept.item<double>()) <= 1e-5 * kept.item<double>());
  REQUIRE(mode.count(CollectiveKind::AllReduce) == (stage == 0 ? 2 : 4));
}

TEST_CASE("clip_grad_norm_: low-precision gradients, no gradients (PyTorch's "
          "test_fsdp_clip_grad_norm.py)",
          "[clip_grad_norm][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  {
    // fp16 gradients give an fp16 total norm (reduced in fp32).
    torch::nn::Linear lin(24, 24);
    lin->to(options().device());
    auto mp = dtensor::MixedPrecisionPolicy().param_dtype(at::kHalf).keep_low_precision_grads(true);
    auto unit = dtensor::fully_shard(*lin, FullyShardOptions().mesh(dp).mp_policy(mp));
    lin->forward(at::randn({32, 24}, options(at::kHalf))).sum().backward();
    REQUIRE(lin->weight.grad().scalar_type() == at::kHalf);
    auto total = unit.clip_grad_norm_(1.0);
    REQUIRE(total.scalar_type() == at::kHalf);
    auto expected =
        at::linalg_vector_norm(at::cat({full_value(lin->weight.grad()).reshape(-1).to(at::kFloat),
                                        full_value(lin->bias.grad()).to(at::kFloat)}),
                               2);
    REQUIRE(expected.item<double>() <= 1.0 + 1e-3); // clipped
  }
  {
    // No gradients: a zero fp32 norm and a warning naming the rank.
    torch::nn::Linear lin(24, 24);
    lin->to(options().device());
    auto unit = dtensor::fully_shard(*lin, FullyShardOptions().mesh(dp));
    struct Capture : c10::WarningHandler {
      std::string text;
      void process(const c10::Warning& w) override { text += w.msg(); }
    } capture;
    at::Tensor total;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&capture);
      total = unit.clip_grad_norm_(1.0);
    }
    REQUIRE_THAT(capture.text,
                 contains("on rank " + std::to_string(rank()) +
                          " with no gradients -- returning the total norm in the default dtype "
                          "torch.float32"));
    REQUIRE(total.scalar_type() == at::kFloat);
    REQUIRE(DTensor(total).full_tensor().item<double>() == 0.0);
  }
}

// The full grid runs on 1 and 2 ranks (on 4 ranks sharing 2 cores it would take minutes; the
// 4-rank paths are covered by the cases above). SGD instead of the PyTorch test's Adam for the
// steps after the first: Adam's first updates are ~lr * sign(grad), which turns the last-bit
// differences of a reduce-scatter versus an all-reduce on near-zero gradient elements into
// differences of 2 * lr.
TEST_CASE("clip_grad_norm_: DDP parity grid of PyTorch's test_fsdp_clip_grad_norm.py on "
          "TransformerWithSharedParams",
          "[clip_grad_norm][world1][world2]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  using dtensor::models::TransformerWithSharedParams;
  auto layers_of = [](torch::nn::Module& m, const std::string& kind) {
    std::vector<std::shared_ptr<torch::nn::Module>> out;
    for (const auto& item : m.named_modules()) {
      const std::string name = item.value()->name();
      const bool is_layer = name.find("Layer") != std::string::npos;
      if (name.find(kind) != std::string::npos &&
          (is_layer || kind.find("Layer") == std::string::npos)) {
        out.push_back(item.value());
      }
    }
    return out;
  };
  for (double max_norm : {1.0, 2.5}) {
    for (double norm_type : {1.0, 2.0, kInf}) {
      // FULL_SHARD (each encoder / decoder layer and the root), NO_SHARD (replicate),
      // mixed (encoder replicated, decoder and root fully sharded), FULL_SHARD + CPU offload.
      for (const std::string strategy : {"full_shard", "no_shard", "mixed", "full_shard_offload"}) {
        INFO("max_norm " << max_norm << " norm_type " << norm_type << " " << strategy);
        TransformerWithSharedParams ref(rank(), true, /*deterministic=*/true);
        ref->to(options().device());
        auto ref_handle = dtensor::replicate(*ref, dp);
        TransformerWithSharedParams model(rank(), true, true);
        model->to(options().device());
        dtensor::ReplicateHandle replicated;
        auto opts = FullyShardOptions().mesh(dp);
        if (strategy == "full_shard_offload") {
          opts.offload_policy(dtensor::OffloadPolicy().offload_to_cpu(true));
        }
        if (strategy == "no_shard") {
          replicated = dtensor::replicate(*model, dp);
        } else if (strategy == "mixed") {
          auto encoder = layers_of(*model, "TransformerEncoder").at(0);
          replicated = dtensor::replicate(*encoder, dp);
          dtensor::fully_shard(*layers_of(*model, "TransformerDecoder").at(0), opts);
          dtensor::fully_shard(*model,
                               FullyShardOptions(opts).ignored_params(encoder->parameters()));
        } else {
          for (const char* kind : {"TransformerEncoderLayer", "TransformerDecoderLayer"}) {
            for (auto& layer : layers_of(*model, kind)) {
              dtensor::fully_shard(*layer, opts);
            }
          }
          dtensor::fully_shard(*model, opts);
        }
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
        torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
        for (int iter = 0; iter < 2; ++iter) {
          INFO("iteration " << iter);
          opt.zero_grad();
          ref_opt.zero_grad();
          for (auto* m : {&model, &ref}) {
            auto input = (*m)->get_input(options().device());
            (*m)->get_loss(input, (*m)->forward(input[0], input[1])).backward();
          }
          torch::NoGradGuard no_grad;
          for (auto* m : {&model, &ref}) {
            for (auto& p : (*m)->parameters()) {
              if (p.grad().defined()) {
                p.mutable_grad().mul_(100); // LARGE_FACTOR: the clip is never vacuous
              }
            }
          }
          std::vector<at::Tensor> before;
          for (auto& p : model->parameters()) {
            before.push_back(p.grad().defined() ? full_value(p.grad()).clone() : at::Tensor());
          }
          const double ref_total =
              torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm, norm_type);
          CommDebugMode mode;
          at::Tensor total = dtensor::clip_grad_norm_(model->parameters(), max_norm, norm_type);
          const bool sharded = strategy != "no_shard";
          REQUIRE(dtensor::is_dtensor(total) == sharded);
          REQUIRE(mode.count(CollectiveKind::AllReduce) == (sharded ? over(dp.size(), 1) : 0));
          REQUIRE(mode.total_count() == (sharded ? over(dp.size(), 1) : 0));
          const double got =
              sharded ? DTensor(total).full_tensor().item<double>() : total.item<double>();
          REQUIRE(std::abs(got - ref_total) <= 1e-4 * std::max(1.0, ref_total));
          auto p = model->parameters();
          auto q = ref->parameters();
          for (size_t i = 0; i < p.size(); ++i) {
            if (!before[i].defined()) {
              continue;
            }
            REQUIRE_FALSE(at::equal(full_value(p[i].grad()), before[i]));
            REQUIRE(near(full_value(p[i].grad()), q[i].grad()));
          }
          opt.step();
          ref_opt.step();
          for (size_t i = 0; i < p.size(); ++i) {
            REQUIRE(near(full_value(p[i]), q[i]));
          }
        }
      }
    }
  }
}
