// The parity test of PyTorch's test_fsdp_sharded_grad_scaler.py in per-parameter terms:
// fully_shard + GradScaler trains exactly as replicate + GradScaler (the DDP reference) on
// common_fsdp.py's NestedWrappedModule, over CPU offload x {reshard after forward, keep
// unsharded} x {fp16 mixed precision, none}, for several steps including one whose gradients
// overflow (injected on one rank's shard only); also with frozen parameters
// (NonUniformReqGradNWM) and on TransformerWithSharedParams.
#include <ATen/autocast_mode.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "support/prelude.h"
#include <models/fsdp_models.h>

using dtensor::GradScaler;
using dtensor::GradScalerOptions;
using dtensor::models::NestedWrappedModule;
using dtensor::models::NonUniformReqGradNWM;
using dtensor::models::TransformerWithSharedParams;

namespace {

// [Note: the fp16 reference] fully_shard with param_dtype = reduce_dtype = fp16 computes
// forward and backward in fp16 from fp32 master weights and reduces in fp16. The reference
// does the same with CPU autocast (fp16 linears over fp32 weights) and replicate's fp16
// reduction, as PyTorch's parity test runs DDP under autocast. The two differ only in
// rounding, so fp16 runs are compared with fp16 tolerances.
struct Autocast {
  explicit Autocast(bool on) : on_(on) {
    if (on_) {
      at::autocast::set_autocast_dtype(c10::kCPU, c10::kHalf);
      at::autocast::set_autocast_enabled(c10::kCPU, true);
    }
  }
  ~Autocast() {
    if (on_) {
      at::autocast::set_autocast_enabled(c10::kCPU, false);
      at::autocast::clear_cache();
    }
  }
  bool on_;
};

// Writes inf into element 0 of p's gradient: its local shard on rank `on_rank` only for a
// DTensor gradient, every rank's copy for a replicated plain gradient (all equal after the
// all-reduce, so every rank sees the overflow, as a real one would be).
void poison(const at::Tensor& p, int on_rank) {
  at::Tensor g = p.grad();
  const bool sharded = dtensor::is_dtensor(g);
  if (sharded && rank() != on_rank) {
    return;
  }
  at::Tensor local = sharded ? DTensor(g).to_local() : g;
  if (local.numel() > 0) {
    c10::NoGradGuard no_grad;
    local.view(-1)[0].fill_(INFINITY);
  }
}

struct Run {
  std::vector<double> losses;
  std::vector<bool> stepped;
  std::vector<double> scales;
};

constexpr int kSteps = 4;
constexpr int kInfStep = 2;

// The model's loss on this rank's batch (get_input reseeds, so both models see the same).
template <class M>
at::Tensor loss_of(M& model, bool fp16_input);

template <>
at::Tensor loss_of(NestedWrappedModule& model, bool fp16_input) {
  auto input = model->get_input(options().device());
  if (fp16_input) {
    input[0] = input[0].to(c10::kHalf); // [Note: no input casting] in fully_shard.h
  }
  return model->get_loss(input, model->forward(input[0]));
}

template <>
at::Tensor loss_of(NonUniformReqGradNWM& model, bool fp16_input) {
  auto input = model->get_input(options().device());
  if (fp16_input) {
    input[0] = input[0].to(c10::kHalf);
  }
  return model->get_loss(input, model->forward(input[0]));
}

template <>
at::Tensor loss_of(TransformerWithSharedParams& model, bool) {
  auto input = model->get_input(options().device());
  return model->get_loss(input, model->forward(input[0], input[1]));
}

// Trains `model` for kSteps with GradScaler and SGD with momentum (Adam would hide the scale).
template <class M>
Run train(M& model, bool fp16_input, bool autocast) {
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  GradScaler scaler(GradScalerOptions().init_scale(2048.0));
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    at::Tensor loss;
    {
      Autocast ac(autocast);
      loss = loss_of(model, fp16_input);
    }
    run.losses.push_back(loss.item<double>());
    scaler.scale(loss).backward();
    if (step == kInfStep) {
      for (const auto& p : model->parameters()) {
        if (p.requires_grad()) {
          poison(p, world() - 1); // the first trained parameter
          break;
        }
      }
    }
    run.stepped.push_back(scaler.step(opt));
    scaler.update();
    run.scales.push_back(scaler.get_scale());
  }
  return run;
}

FullyShardOptions fsdp_options(const dtensor::DeviceMesh& mesh, bool offload, bool reshard,
                               bool fp16) {
  auto opts = FullyShardOptions().mesh(mesh).reshard_after_forward(reshard);
  opts.offload_policy(dtensor::OffloadPolicy().offload_to_cpu(offload));
  if (fp16) {
    opts.mp_policy(
        dtensor::MixedPrecisionPolicy().param_dtype(c10::kHalf).reduce_dtype(c10::kHalf));
  }
  return opts;
}

// common_fsdp.py's recursive wrapping of the NestedWrappedModule family: module.1.0 inside
// module.1, module.2, then the root.
template <class M>
void wrap_nested(M& model, const FullyShardOptions& opts) {
  dtensor::fully_shard(*model->module->ptr(1)->template as<torch::nn::SequentialImpl>()->ptr(0),
                       opts);
  dtensor::fully_shard(*model->module->ptr(1), opts);
  dtensor::fully_shard(*model->module->ptr(2), opts);
  dtensor::fully_shard(*model, opts);
}

// The transformer: every encoder / decoder layer, then the root (the PyTorch test's auto-wrap
// policy).
void wrap_layers(TransformerWithSharedParams& model, const FullyShardOptions& opts) {
  for (const auto& item : model->named_modules()) {
    const std::string kind = item.value()->name();
    if (kind.find("TransformerEncoderLayer") != std::string::npos ||
        kind.find("TransformerDecoderLayer") != std::string::npos) {
      dtensor::fully_shard(*item.value(), opts);
    }
  }
  dtensor::fully_shard(*model, opts);
}

// `ref` under replicate and `model` under fully_shard (wrapped by `wrap`) train alike.
template <class M, class Wrap>
void check_parity(M ref, M model, Wrap wrap, bool offload, bool reshard, bool fp16) {
  INFO("offload " << offload << " reshard " << reshard << " fp16 " << fp16);
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  ref->to(options().device());
  model->to(options().device());
  dtensor::ReplicateOptions ropts;
  if (fp16) {
    ropts.reduce_dtype(c10::kHalf);
  }
  auto ddp = dtensor::replicate(*ref, mesh, ropts); // keep the handle alive while training
  wrap(model, fsdp_options(mesh, offload, reshard, fp16));

  const Run want = train(ref, false, fp16);
  const Run got = train(model, fp16, false);
  const double tol = fp16 ? 1e-2 : 1e-5;
  for (int s = 0; s < kSteps; ++s) {
    INFO("step " << s);
    REQUIRE(got.stepped[s] == want.stepped[s]);
    REQUIRE(got.stepped[s] == (s != kInfStep)); // only the injected overflow skips
    REQUIRE(got.scales[s] == want.scales[s]);
    REQUIRE(std::abs(got.losses[s] - want.losses[s]) <= tol * (1 + std::abs(want.losses[s])));
  }
  auto a = model->parameters();
  auto b = ref->parameters();
  REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    INFO("parameter " << k);
    REQUIRE(a[k].scalar_type() == c10::kFloat); // fp32 master weights
    REQUIRE(close(full_value(a[k]), b[k], tol, tol));
  }
}

} // namespace

TEST_CASE("GradScaler: fully_shard trains as replicate, offload x reshard x fp16 (PyTorch's "
          "test_fsdp_sharded_grad_scaler.py)",
          "[grad_scaler_parity][world1][world2][world4]") {
  for (bool offload : {false, true}) {
    for (bool reshard : {true, false}) {
      for (bool fp16 : {false, true}) {
        check_parity(NestedWrappedModule(rank(), /*deterministic=*/true),
                     NestedWrappedModule(rank(), true), wrap_nested<NestedWrappedModule>, offload,
                     reshard, fp16);
      }
    }
  }
}

TEST_CASE("GradScaler: parity with frozen parameters (NonUniformReqGradNWM, PyTorch's "
          "test_fsdp_sharded_grad_scaler.py)",
          "[grad_scaler_parity][world1][world2][world4]") {
  using dtensor::models::nonuniform_req_grad_nwm;
  for (bool offload : {false, true}) {
    for (bool fp16 : {false, true}) {
      check_parity(nonuniform_req_grad_nwm(rank(), true), nonuniform_req_grad_nwm(rank(), true),
                   wrap_nested<NonUniformReqGradNWM>, offload, /*reshard=*/true, fp16);
    }
  }
}

TEST_CASE("GradScaler: parity on TransformerWithSharedParams (PyTorch's "
          "test_fsdp_sharded_grad_scaler.py model, fp32)",
          "[grad_scaler_parity][world1][world2][world4]") {
  // fp32 only: with fp16 the reference's autocast and fully_shard's fp16 parameters draw the
  // dropout masks from differently typed tensors, so the two runs would not see the same masks.
  for (bool offload : {false, true}) {
    for (bool reshard : {true, false}) {
      check_parity(TransformerWithSharedParams(rank(), /*add_bn=*/true, /*deterministic=*/true),
                   TransformerWithSharedParams(rank(), true, true), wrap_layers, offload, reshard,
                   /*fp16=*/false);
    }
  }
}
