// The Llama-3 recipe's model (models/llama3.h): built on the meta device,
// tensor-parallel as torchtitan's apply_tp (sequence-parallel norms, column / row-wise
// projections, row-wise embedding) and fully sharded over (dp_replicate, dp_shard), its
// init_weights run after sharding. Judged against the plain model on one process: every
// initial parameter, the logits and the gradients of one backward pass.
#include <torch/nn/functional/loss.h>

#include <dtensor/context_parallel.h>
#include <models/llama3.h>

#include "support/prelude.h"

using dtensor::models::Llama3;
using dtensor::models::Llama3Args;
using dtensor::testing::near;

namespace {

constexpr int64_t kVocab = 256;
constexpr int64_t kBatch = 4;
constexpr int64_t kSeq = 8;

// (dp_replicate, dp_shard, tp): 2x2x2 on 8 ranks, 1x2x2 on 4, 1x1x2 on 2, 1x1x1 on 1.
std::vector<int64_t> mesh_shape() {
  switch (world()) {
  case 8:
    return {2, 2, 2};
  case 4:
    return {1, 2, 2};
  case 2:
    return {1, 1, 2};
  default:
    return {1, 1, 1};
  }
}

// Built on meta, parallelized, materialized, initialized: only this rank's shards, ever.
Llama3 build(const DeviceMesh& mesh, const dtensor::RngState& seed,
             const std::optional<dtensor::ContextParallel>& cp = std::nullopt) {
  Llama3 model{nullptr};
  {
    dtensor::MetaDeviceGuard meta;
    model = Llama3(dtensor::models::llama3_tiny_args());
  }
  dtensor::models::parallelize_llama3(model, mesh, /*loss_parallel=*/false, {}, std::nullopt, cp);
  dtensor::to_empty(*model, options().device());
  dtensor::set_rng_state(seed);
  model->init_weights();
  return model;
}

at::Tensor whole(const at::Tensor& t) {
  return dtensor::is_dtensor(t) ? DTensor(t).full_tensor() : t;
}

} // namespace

TEST_CASE("llama3: meta init, TP x HSDP, equals the plain model (parameters, logits, gradients)",
          "[llama3][world1][world2][world4][world8]") {
  const DeviceMesh mesh =
      init_device_mesh(device_type(), mesh_shape(), {"dp_replicate", "dp_shard", "tp"});
  INFO("mesh " << mesh.to_string());
  const dtensor::RngState seed{true, 7, 0};
  Llama3 model = build(mesh, seed);
  Llama3 ref(dtensor::models::llama3_tiny_args());
  ref->to(options().device());
  dtensor::set_rng_state(seed);
  ref->init_weights();

  auto p = model->named_parameters();
  auto q = ref->named_parameters();
  REQUIRE(p.size() == q.size());
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("initial " << p[i].key());
    REQUIRE(p[i].key() == q[i].key());
    REQUIRE(same(full_value(p[i].value()), q[i].value().detach()));
  }

  at::manual_seed(100); // the same batch on every rank
  const at::Tensor tokens = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
  const at::Tensor targets = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
  CommDebugMode mode;
  const at::Tensor logits = whole(dtensor::call(model, tokens));
  // torchtitan's forward: per block, attention's and feed_forward's sequence-sharded input
  // gathered once each and wo / w2 reduce-scattered; the embedding's masked partial
  // reduce-scattered; the final norm's output gathered for `output`, and the logits. Each
  // fully_shard unit gathered over dp_shard: torchtitan's units, tok_embeddings, each block
  // and [norm, output] (the root holds no parameter of its own then).
  const auto counts = mode.counts_by_group();
  const int64_t layers = dtensor::models::llama3_tiny_args().n_layers();
  auto count = [&](const std::string& group, CollectiveKind kind) {
    auto g = counts.find(group);
    return g == counts.end() || g->second.count(kind) == 0 ? 0 : g->second.at(kind);
  };
  const bool tp = mesh.size(2) > 1;
  CHECK(count("tp", CollectiveKind::AllGather) == (tp ? 2 * layers + 2 : 0));
  CHECK(count("tp", CollectiveKind::ReduceScatter) == (tp ? 2 * layers + 1 : 0));
  CHECK(count("dp_shard", CollectiveKind::AllGather) == over(mesh.size(1), layers + 2));
  CHECK(mode.total_count() == count("tp", CollectiveKind::AllGather) +
                                  count("tp", CollectiveKind::ReduceScatter) +
                                  count("dp_shard", CollectiveKind::AllGather));
  const at::Tensor want = ref->forward(tokens);
  REQUIRE(logits.sizes().vec() == std::vector<int64_t>{kBatch, kSeq, kVocab});
  REQUIRE(near(logits.detach(), want.detach()));

  auto loss = torch::nn::functional::cross_entropy(logits.view({-1, kVocab}), targets.reshape(-1));
  auto ref_loss =
      torch::nn::functional::cross_entropy(want.view({-1, kVocab}), targets.reshape(-1));
  {
    // torchtitan's backward (no AC here): each sequence-sharded input gathered in forward
    // (attention's, feed_forward's, output's) reduce-scattered once, and each forward
    // reduce-scatter (wo, w2, the embedding) an all-gather; the logits' gather (loss_parallel
    // off) reduced back to the vocabulary shards locally.
    CommDebugMode backward;
    loss.backward();
    const auto b = backward.counts_by_group();
    auto bcount = [&](const std::string& group, CollectiveKind kind) {
      auto g = b.find(group);
      return g == b.end() || g->second.count(kind) == 0 ? 0 : g->second.at(kind);
    };
    CHECK(bcount("tp", CollectiveKind::ReduceScatter) == (tp ? 2 * layers + 1 : 0));
    CHECK(bcount("tp", CollectiveKind::AllGather) == (tp ? 2 * layers + 1 : 0));
  }
  ref_loss.backward();
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("gradient of " << p[i].key());
    REQUIRE(p[i].value().grad().defined());
    REQUIRE(near(full_value(p[i].value().grad()), q[i].value().grad()));
  }
}

TEST_CASE("llama3: context parallel (both methods) x TP x fully_shard over dp_shard x cp equals "
          "the plain model (logits, gradients)",
          "[llama3][world4][world8]") {
  // (dp_replicate, dp_shard, cp, tp): 1x2x2x2 on 8 ranks (the recipe's cp layout), 1x1x2x2 on 4.
  const std::vector<int64_t> shape =
      world() == 8 ? std::vector<int64_t>{1, 2, 2, 2} : std::vector<int64_t>{1, 1, 2, 2};
  const dtensor::RngState seed{true, 7, 0};
  Llama3 ref(dtensor::models::llama3_tiny_args());
  ref->to(options().device());
  dtensor::set_rng_state(seed);
  ref->init_weights();
  at::manual_seed(100); // the same batch on every rank
  const at::Tensor tokens = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
  const at::Tensor targets = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
  const at::Tensor want = ref->forward(tokens);
  torch::nn::functional::cross_entropy(want.view({-1, kVocab}), targets.reshape(-1)).backward();
  auto q = ref->named_parameters();

  for (dtensor::CpMethod method : {dtensor::CpMethod::AllGather, dtensor::CpMethod::Ring}) {
    INFO(dtensor::name_of(method));
    const DeviceMesh mesh =
        init_device_mesh(device_type(), shape, {"dp_replicate", "dp_shard", "cp", "tp"});
    dtensor::ContextParallel cp(dtensor::ContextParallelOptions().method(method));
    Llama3 model = build(mesh, seed, cp);
    const DeviceMesh cp_mesh = mesh["cp"];
    // Each cp rank holds chunks r and 3 - r of the 8 tokens (head-tail), its labels the same.
    const dtensor::CpLayout layout(kSeq, cp_mesh.size(), dtensor::CpBalance::HeadTail);
    cp.set_layout(layout);
    const at::Tensor logits =
        whole(dtensor::call(model, dtensor::cp_shard(tokens, 1, layout, cp_mesh)));
    CHECK(near(dtensor::cp_unshard(logits.detach(), 1, layout, cp_mesh), want.detach()));
    // A mean over this rank's tokens; fully_shard averages the gradients over dp_shard x cp,
    // which (equal token counts) is the gradient of the mean over the whole batch.
    torch::nn::functional::cross_entropy(logits.view({-1, kVocab}),
                                         dtensor::cp_shard(targets, 1, layout, cp_mesh).reshape(-1))
        .backward();
    auto p = model->named_parameters();
    REQUIRE(p.size() == q.size());
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("gradient of " << p[i].key());
      REQUIRE(p[i].value().grad().defined());
      CHECK(near(full_value(p[i].value().grad()), q[i].value().grad()));
    }
  }
}

TEST_CASE("llama3: document masks (set_documents) equal each document run alone, on every "
          "layout (TP x HSDP), gradients included",
          "[llama3][world1][world2][world4][world8]") {
  // [Note: document masks]: rotary embeddings depend on relative positions only, so a
  // document's logits under the mask are the plain model's on that document by itself.
  const DeviceMesh mesh =
      init_device_mesh(device_type(), mesh_shape(), {"dp_replicate", "dp_shard", "tp"});
  const dtensor::RngState seed{true, 11, 0};
  Llama3 model = build(mesh, seed);
  Llama3 ref(dtensor::models::llama3_tiny_args());
  ref->to(options().device());
  dtensor::set_rng_state(seed);
  ref->init_weights();
  at::manual_seed(101); // the same batch on every rank
  const at::Tensor tokens = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
  // Rows 0 and 1 share their documents (one call), 2 and 3 have their own; lengths of 1 too.
  const std::vector<std::vector<int64_t>> docs = {{3, 1, 4}, {3, 1, 4}, {8}, {5, 2, 1}};
  model->set_documents(docs);
  const at::Tensor logits = whole(dtensor::call(model, tokens));
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < kBatch; ++b) {
    std::vector<at::Tensor> pieces;
    int64_t start = 0;
    for (int64_t len : docs[static_cast<size_t>(b)]) {
      pieces.push_back(ref->forward(tokens.narrow(0, b, 1).narrow(1, start, len)));
      start += len;
    }
    rows.push_back(at::cat(pieces, 1));
  }
  const at::Tensor want = at::cat(rows, 0);
  REQUIRE(near(logits.detach(), want.detach()));
  // The mask matters: the whole rows' causal logits differ from these.
  CHECK(!near(ref->forward(tokens).detach(), want.detach()));
  logits.sum().backward();
  want.sum().backward();
  auto p = model->named_parameters();
  auto q = ref->named_parameters();
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("gradient of " << p[i].key());
    REQUIRE(near(full_value(p[i].value().grad()), q[i].value().grad()));
  }
  model->set_documents({});
  CHECK(near(whole(dtensor::call(model, tokens)).detach(), ref->forward(tokens).detach()));
}
