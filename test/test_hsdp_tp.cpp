// HSDP x TP: fully_shard over a (dp_replicate, dp_shard) mesh around parameters
// tensor-parallel on the third dim, tp, of the same 3-D mesh -- (2, 2, 2) on 8 ranks, (1, 2, 2),
// (2, 1, 2) and (2, 2, 1) on 4. Judged against the plain model on one process (losses,
// clipped gradients and norms, parameters, full state dict) with exact collective counts per
// forward, backward and clip step; then a checkpoint saved from the 3-D layout is loaded into
// FSDP x TP (2-D) and FSDP (1-D) and gives the same values.
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>

#include <dtensor/checkpoint.h>

#include "support/prelude.h"
#include "support/transformer_tp.h"

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

constexpr int64_t kUnits = 3; // two blocks and the root

// The model on the 3-D mesh: tensor parallelism on tp, then each block and the root fully
// sharded over (dp_replicate, dp_shard).
Transformer hsdp_tp(const DeviceMesh& mesh) {
  torch::manual_seed(0);
  Transformer model(small_transformer_args(0.0));
  model->to(options().device());
  parallelize_transformer_tp(model, mesh["tp"]);
  const DeviceMesh dp = mesh[{"dp_replicate", "dp_shard"}];
  for (auto& layer : *model->layers) {
    dtensor::fully_shard(*layer, FullyShardOptions().mesh(dp));
  }
  dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  return model;
}

std::vector<std::vector<int64_t>> shapes() {
  if (world() == 8) {
    return {{2, 2, 2}};
  }
  return {{1, 2, 2}, {2, 1, 2}, {2, 2, 1}};
}

} // namespace

TEST_CASE("HSDP x TP: parity with the plain model, exact counts, checkpoint to 2-D and 1-D",
          "[hsdp_tp][world4][world8]") {
  for (const auto& shape : shapes()) {
    const DeviceMesh mesh =
        init_device_mesh(device_type(), shape, {"dp_replicate", "dp_shard", "tp"});
    INFO("mesh " << mesh.to_string());
    const int64_t tp = mesh.size(2);
    const int64_t ds = mesh.size(1); // dp_shard: fully_shard issues nothing over one rank
    Transformer model = hsdp_tp(mesh);
    torch::manual_seed(0);
    Transformer ref(small_transformer_args(0.0));
    ref->to(options().device());

    // A column-wise weight: tp's Shard(0), replicated over dp_replicate, its tp shard sharded
    // again over dp_shard ([Note: FSDP x TP]).
    const DTensor wq(model->layers[0]->as<dtensor::models::TransformerBlockImpl>()->attention->wq->weight);
    REQUIRE(wq.device_mesh().dim_names() ==
            std::vector<std::string>{"tp", "dp_replicate", "dp_shard"});
    REQUIRE(wq.placements() ==
            Placements{Placement::shard(0), Placement::replicate(), Placement::shard(0)});
    auto p = model->named_parameters();
    auto q = ref->named_parameters();
    REQUIRE(p.size() == q.size());
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("initial " << p[i].key());
      REQUIRE(same(full_value(p[i].value()), q[i].value().detach()));
    }

    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const auto [index, count] = batch_slice(mesh[{"dp_replicate", "dp_shard"}]);
    const int64_t rows = kBatch / count;
    for (int step = 0; step < 2; ++step) {
      INFO("step " << step);
      at::manual_seed(300 + step); // the same global batch on every rank
      auto tokens = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
      auto targets = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
      auto my_targets = targets.narrow(0, index * rows, rows).reshape(-1);

      // Forward: one all-gather per unit over dp_shard; over tp one all-reduce per embedding
      // (the row-wise embedding looks its vocab-sharded table up in place: [Note: masked
      // lookups]) and per row-wise projection; nothing over dp_replicate.
      CommDebugMode forward;
      auto logits = model->forward(tokens.narrow(0, index * rows, rows));
      auto loss = torch::nn::functional::cross_entropy(whole(logits).view({-1, kVocab}), my_targets);
      CHECK(forward.count("dp_shard", CollectiveKind::AllGather) == over(ds, kUnits));
      CHECK(forward.count("tp", CollectiveKind::AllGather) == 0);
      CHECK(forward.count("tp", CollectiveKind::AllReduce) == over(tp, 2 + 2 * 2));
      CHECK(forward.total_count() == over(ds, kUnits) + over(tp, 6));

      // Backward: the blocks (resharded after forward; the root is not) all-gathered again
      // over dp_shard; per unit one reduce-scatter over dp_shard and one all-reduce over
      // dp_replicate; over tp one all-reduce per block input of a column-wise projection
      // (attention's, the MLP's: Partial input gradients).
      CommDebugMode backward;
      loss.backward();
      CHECK(backward.count("dp_shard", CollectiveKind::AllGather) == over(ds, kUnits - 1));
      CHECK(backward.count("dp_shard", CollectiveKind::ReduceScatter) == over(ds, kUnits));
      CHECK(backward.count("dp_replicate", CollectiveKind::AllReduce) == kUnits);
      CHECK(backward.count("tp", CollectiveKind::AllReduce) == over(tp, 2 * 2));
      CHECK(backward.total_count() == over(ds, 2 * kUnits - 1) + kUnits + over(tp, 4));

      // clip_grad_norm_: one all-reduce per mesh dim some gradient is sharded over (tp and
      // dp_shard, unless of one rank; none over dp_replicate, where all is replicated).
      CommDebugMode clip;
      const double norm = dtensor::clip_grad_norm_(model->parameters(), 0.5).item<double>();
      CHECK(clip.count("tp", CollectiveKind::AllReduce) == over(tp, 1));
      CHECK(clip.count("dp_shard", CollectiveKind::AllReduce) == over(mesh.size(1), 1));
      CHECK(clip.total_count() == over(tp, 1) + over(mesh.size(1), 1));

      auto ref_logits = ref->forward(tokens);
      auto ref_my_loss = torch::nn::functional::cross_entropy(
          ref_logits.narrow(0, index * rows, rows).reshape({-1, kVocab}), my_targets);
      torch::nn::functional::cross_entropy(ref_logits.view({-1, kVocab}), targets.view(-1)).backward();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
      REQUIRE(near(loss.detach(), ref_my_loss.detach()));
      REQUIRE(std::abs(norm - ref_norm) <= 1e-4 * std::max(1.0, ref_norm));
      for (size_t i = 0; i < p.size(); ++i) {
        INFO("clipped grad " << p[i].key());
        REQUIRE(near(full_value(p[i].value().grad()), q[i].value().grad()));
      }
      opt.step();
      ref_opt.step();
      opt.zero_grad();
      ref_opt.zero_grad();
      for (size_t i = 0; i < p.size(); ++i) {
        INFO("param " << p[i].key());
        REQUIRE(near(full_value(p[i].value()), q[i].value().detach()));
      }
    }

    // The full state dict holds the plain model's values.
    auto full = dtensor::get_model_state_dict(*model, dtensor::StateDictOptions().full_state_dict(true));
    for (size_t i = 0; i < q.size(); ++i) {
      INFO("full state dict " << q[i].key());
      REQUIRE(near(*full.find(q[i].key()), q[i].value().detach()));
    }

    // Saved from 3-D, loaded into FSDP x TP on (dp, tp) and into FSDP on the whole world.
    const std::string dir = dtensor::testing::fresh_shared_dir("hsdp-tp-tests", "resharded");
    dtensor::checkpoint::save(dtensor::get_model_state_dict(*model), dir);
    const DeviceMesh mesh_2d = init_device_mesh(device_type(), {world() / 2, 2}, {"dp", "tp"});
    const DeviceMesh mesh_1d = init_device_mesh(device_type(), {world()}, {"dp"});
    for (int ndim : {2, 1}) {
      INFO("loaded into a " << ndim << "-D layout");
      torch::manual_seed(1); // other initial values, overwritten by the load
      Transformer other(small_transformer_args(0.0));
      other->to(options().device());
      if (ndim == 2) {
        parallelize_transformer_tp(other, mesh_2d["tp"]);
      }
      const DeviceMesh dp = ndim == 2 ? mesh_2d["dp"] : mesh_1d;
      for (auto& layer : *other->layers) {
        dtensor::fully_shard(*layer, FullyShardOptions().mesh(dp));
      }
      dtensor::fully_shard(*other, FullyShardOptions().mesh(dp));
      auto state = dtensor::get_model_state_dict(*other);
      dtensor::checkpoint::load(state, dir);
      const DTensor w(other->layers[0]->as<dtensor::models::TransformerBlockImpl>()->attention->wq->weight);
      REQUIRE(w.device_mesh().ndim() == ndim);
      auto r = other->named_parameters();
      for (size_t i = 0; i < q.size(); ++i) {
        INFO("loaded " << q[i].key());
        REQUIRE(near(full_value(r[i].value()), q[i].value().detach()));
      }
    }
  }
}
