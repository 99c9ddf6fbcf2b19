// Pipeline parallelism (include/dtensor/pipelining.h): every schedule trains a small model
// cut into stages on 2 and 4 pipeline ranks; losses and every parameter's gradient equal the
// plain model's on one process (fp32, atol 1e-6), for a sum loss over the global count and a
// mean loss (PyTorch's default scale_grads); each rank's point-to-point transfers are counted
// exactly (one send of each activation and one of each input gradient across every stage boundary
// between ranks, per microbatch); bad input is refused naming what was wrong.
#include <cmath>
#include <set>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>

#include <dtensor/clip_grad.h>
#include <dtensor/materialize.h>
#include <dtensor/pipelining.h>
#include <dtensor/replicate.h>
#include <models/llama3.h>

#include "pipelining/small_model.h"
#include "support/prelude.h"

using dtensor::PipelineOrder;
using dtensor::ScheduleKind;
using namespace pipeline_test;

namespace {

struct Case {
  ScheduleKind kind;
  int stages_per_rank;
};

const std::vector<Case> kCases = {
    {ScheduleKind::GPipe, 1},
    {ScheduleKind::OneFOneB, 1},
    {ScheduleKind::Interleaved1F1B, 2},
    {ScheduleKind::LoopedBFS, 2},
    {ScheduleKind::InterleavedZeroBubble, 2},
    {ScheduleKind::ZBVZeroBubble, 2},
    {ScheduleKind::DualPipeV, 2},
};

} // namespace

TEST_CASE("every schedule's gradients equal the plain model's", "[pipelining][world2][world4]") {
  const DeviceMesh pp_mesh = init_device_mesh(device_type(), {world()}, {"pp"});
  auto pp = pp_mesh.get_group();
  torch::manual_seed(7);
  at::Tensor input = at::randn({kBatch, kWidth});
  at::Tensor target = at::randn({kBatch, kWidth});
  for (bool mean : {false, true}) {
    Model plain(1);
    at::Tensor full = plain.run(input, 0, 8);
    at::Tensor plain_loss = mean ? mean_loss(full, target) : sum_loss(full, target);
    plain_loss.backward();
    for (const auto& c : kCases) {
      INFO(dtensor::schedule_name(c.kind) << (mean ? ", mean loss" : ", sum loss"));
      int num_stages = world() * c.stages_per_rank;
      auto order = dtensor::generate_schedule(c.kind, world(), 8, c.stages_per_rank);
      Model model(1);
      // The mean loss with PyTorch's default (scale_grads: the gradients divided by the
      // number of microbatches after the last backward), the sum loss without it.
      dtensor::PipelineSchedule schedule(
          stages_of(model, order, num_stages), pp, order, 8, mean ? mean_loss : sum_loss,
          mean ? dtensor::PipelineOptions() : dtensor::PipelineOptions().scale_grads(false));
      dtensor::CommDebugMode mode;
      auto losses = schedule.step(input, target);
      // The losses, on the last stage's rank, add up to the plain model's.
      auto placement = dtensor::validate_schedule(order, num_stages, 8);
      if (placement[num_stages - 1] == rank()) {
        REQUIRE(losses.size() == 8);
        at::Tensor total = at::stack(losses).sum();
        CHECK(close(mean ? total / 8 : total, plain_loss.detach()));
      } else {
        CHECK(losses.empty());
      }
      // Gradients of this rank's layers equal the plain model's.
      int per = 8 / num_stages;
      for (int s = 0; s < num_stages; ++s) {
        for (int i = s * per; i < (s + 1) * per; ++i) {
          if (placement[s] != rank()) {
            CHECK(!model.layers[i]->weight.grad().defined());
            continue;
          }
          CHECK(close(model.layers[i]->weight.grad(), plain.layers[i]->weight.grad()));
          CHECK(close(model.layers[i]->bias.grad(), plain.layers[i]->bias.grad()));
        }
      }
      // One send per activation and per input gradient crossing ranks, per microbatch.
      int64_t sends = 0;
      for (int s = 0; s < num_stages; ++s) {
        if (placement[s] != rank()) {
          continue;
        }
        sends += (s + 1 < num_stages && placement[s + 1] != rank()) ? 8 : 0;
        sends += (s > 0 && placement[s - 1] != rank()) ? 8 : 0;
      }
      CHECK(mode.count(dtensor::CollectiveKind::Send) == sends);
      CHECK(mode.count(dtensor::CollectiveKind::Recv) ==
            sends); // each rank receives as much as it sends here
      CHECK(mode.total_bytes_in() == sends * (kBatch / 8) * kWidth * 4);
      CHECK(mode.count(dtensor::CollectiveKind::AllReduce) == 0);
      // The total norm over every stage's gradients ([Note: the norm over pipeline stages]):
      // the plain model's, for one all-reduce over pp (orders 2 and inf).
      std::vector<at::Tensor> mine, all;
      for (int i = 0; i < 8; ++i) {
        for (const auto& t : {model.layers[i]->weight, model.layers[i]->bias}) {
          if (t.grad().defined()) {
            mine.push_back(t.grad());
          }
        }
        all.push_back(plain.layers[i]->weight.grad());
        all.push_back(plain.layers[i]->bias.grad());
      }
      for (double p : {2.0, static_cast<double>(INFINITY)}) {
        dtensor::CommDebugMode norm_mode;
        const at::Tensor norm = dtensor::get_total_norm(mine, p, false, pp_mesh);
        CHECK(norm_mode.count(dtensor::CollectiveKind::AllReduce) == 1);
        CHECK(close(full_value(norm), dtensor::get_total_norm(all, p)));
      }
    }
  }
}

namespace {

int64_t count_of(const CommDebugMode& mode, const std::string& group, CollectiveKind kind);

} // namespace

// [Note: a communicator per pipeline edge], forced on Gloo (NCCL's default): the gradients
// of the plain model; every transfer on the communicator of its boundary and direction (per
// step, each such communicator of this rank carries the 8 microbatches' sends, or their
// receives), none on the pipeline group; two per boundary this rank shares with another,
// made once (a second schedule over the same edges makes none).
TEST_CASE("a communicator per pipeline edge", "[pipelining][world2][world4]") {
  const DeviceMesh pp_mesh = init_device_mesh(device_type(), {world()}, {"pp"});
  auto pp = pp_mesh.get_group();
  torch::manual_seed(7);
  const at::Tensor input = at::randn({kBatch, kWidth});
  const at::Tensor target = at::randn({kBatch, kWidth});
  Model plain(1);
  sum_loss(plain.run(input, 0, 8), target).backward();
  const auto options = dtensor::PipelineOptions().group_per_edge(true).scale_grads(false);
  for (const Case& c : {Case{ScheduleKind::OneFOneB, 1}, Case{ScheduleKind::ZBVZeroBubble, 2}}) {
    INFO(dtensor::schedule_name(c.kind));
    const int num_stages = world() * c.stages_per_rank;
    const auto order = dtensor::generate_schedule(c.kind, world(), 8, c.stages_per_rank);
    const auto placement = dtensor::validate_schedule(order, num_stages, 8);
    std::vector<std::string> mine; // this rank's edge communicators
    for (int b = 0; b + 1 < num_stages; ++b) {
      if (placement[b] != placement[b + 1] &&
          (placement[b] == rank() || placement[b + 1] == rank())) {
        for (const char* dir : {"F", "B"}) {
          mine.push_back("pp:pp-" + std::to_string(b) + "-" + std::to_string(b + 1) + dir);
        }
      }
    }
    Model model(1);
    const int64_t before = dtensor::num_groups_created();
    dtensor::PipelineSchedule schedule(stages_of(model, order, num_stages), pp, order, 8, sum_loss,
                                       options);
    CHECK(dtensor::num_groups_created() == before); // made at the first step, once agreed
    CommDebugMode mode;
    schedule.step(input, target);
    if (c.kind == ScheduleKind::OneFOneB) { // the first: every edge group is new
      CHECK(dtensor::num_groups_created() - before == static_cast<int64_t>(mine.size()));
    }
    for (const std::string& label : mine) {
      INFO(label);
      CHECK(count_of(mode, label, CollectiveKind::Send) +
                count_of(mode, label, CollectiveKind::Recv) ==
            8);
    }
    CHECK(count_of(mode, "pp", CollectiveKind::Send) == 0);
    CHECK(count_of(mode, "pp", CollectiveKind::Recv) == 0);
    const int per = 8 / num_stages;
    for (int s = 0; s < num_stages; ++s) {
      for (int i = s * per; placement[s] == rank() && i < (s + 1) * per; ++i) {
        CHECK(close(model.layers[i]->weight.grad(), plain.layers[i]->weight.grad()));
        CHECK(close(model.layers[i]->bias.grad(), plain.layers[i]->bias.grad()));
      }
    }
    const int64_t made = dtensor::num_groups_created();
    dtensor::PipelineSchedule again(stages_of(model, order, num_stages), pp, order, 8, sum_loss,
                                    options);
    again.step(input, target);
    CHECK(dtensor::num_groups_created() == made);
  }
}

namespace {

int64_t count_of(const CommDebugMode& mode, const std::string& group, CollectiveKind kind) {
  const auto counts = mode.counts_by_group();
  auto g = counts.find(group);
  return g == counts.end() || g->second.count(kind) == 0 ? 0 : g->second.at(kind);
}

// Sends (= receives) of this rank per step: each microbatch's activation and input gradient
// across every stage boundary between ranks.
int64_t p2p_per_step(const std::vector<int>& placement, int pp_rank, int microbatches) {
  const int n = static_cast<int>(placement.size());
  int64_t sends = 0;
  for (int s = 0; s < n; ++s) {
    if (placement[s] == pp_rank) {
      sends += (s + 1 < n && placement[s + 1] != pp_rank) ? microbatches : 0;
      sends += (s > 0 && placement[s - 1] != pp_rank) ? microbatches : 0;
    }
  }
  return sends;
}

} // namespace

// pp 2 x dp 2 with the small model: the mesh, the batch, its half for this dp rank, and the
// plain model's gradients on the whole batch (the judge).
struct PpDp {
  DeviceMesh mesh = init_device_mesh(device_type(), {2, 2}, {"pp", "dp"});
  dtensor::Group pp = mesh.get_group("pp");
  at::Tensor input, target, my_input, my_target;
  Model plain{1};
  PpDp() {
    torch::manual_seed(7);
    input = at::randn({kBatch, kWidth});
    target = at::randn({kBatch, kWidth});
    const int64_t dp_rank = mesh.get_local_rank("dp");
    my_input = input.chunk(2)[dp_rank];
    my_target = target.chunk(2)[dp_rank];
    sum_loss(plain.run(input, 0, 8), target).backward();
  }
};

constexpr int kMicro = 4; // the pp x dp cases'

// [Note: fully_shard under pipelining] on the small model: pp 2 x dp 2, each layer a unit,
// each stage's module the root; each dp rank trains its half of the batch with a sum loss over
// the global count (divide factor 1: the loss contract, no rescaling afterwards).
TEST_CASE("fully_shard inside pipeline stages: every schedule equals the plain model",
          "[pipelining][world4]") {
  PpDp d;
  const DeviceMesh& mesh = d.mesh;
  const auto& pp = d.pp;
  Model& plain = d.plain;
  for (const auto& c : kCases) {
    INFO(dtensor::schedule_name(c.kind));
    const int num_stages = 2 * c.stages_per_rank;
    auto order = dtensor::generate_schedule(c.kind, 2, kMicro, c.stages_per_rank);
    auto placement = dtensor::validate_schedule(order, num_stages, kMicro);
    Model model(1);
    auto stages = stages_of(model, order, num_stages, kMicro, pp.rank());
    // torchtitan's choice under pipelining: no reshard after forward (each microbatch's
    // forward and backward would gather the layers again).
    const auto fsdp = FullyShardOptions().mesh(mesh["dp"]).reshard_after_forward(false);
    for (auto& st : stages) {
      for (auto& child : st.module->children()) {
        dtensor::fully_shard(*child, fsdp).set_gradient_divide_factor(1.0);
      }
      dtensor::fully_shard(*st.module, fsdp).set_gradient_divide_factor(1.0);
    }
    dtensor::PipelineSchedule schedule(std::move(stages), pp, order, kMicro, sum_loss, kSumLoss);
    int64_t buffers = 0;
    for (int step = 0; step < 2; ++step) { // the second step accumulates onto the first's
      CommDebugMode mode;
      schedule.step(d.my_input, d.my_target);
      // One all-gather and one reduce-scatter per layer of this rank (4) per step: the stage
      // unsharded once, gradients reduced once at REDUCE_GRAD, not per microbatch.
      CHECK(count_of(mode, "dp", CollectiveKind::AllGather) == 4);
      CHECK(count_of(mode, "dp", CollectiveKind::ReduceScatter) == 4);
      const int64_t sends = p2p_per_step(placement, pp.rank(), kMicro);
      CHECK(mode.count(CollectiveKind::Send) == sends);
      CHECK(mode.count(CollectiveKind::Recv) == sends);
      CHECK(mode.total_count() == 8 + 2 * sends);
      // [Note: receive buffers]: reused as what they held dies; the second step allocates as
      // many as the first (they are let go of between steps).
      // GPipe's last stage holds every microbatch's input until the backwards; every other
      // schedule here needs fewer buffers than it has receives (1F1B: 1-2 of 4).
      CHECK(schedule.receive_buffer_count() <= sends);
      if (c.kind != ScheduleKind::GPipe) {
        CHECK(schedule.receive_buffer_count() < sends);
      }
      if (step == 1) {
        CHECK(schedule.receive_buffer_count() == buffers);
      }
      buffers = schedule.receive_buffer_count();
    }
    for (int i = 0; i < 8; ++i) {
      if (placement[i / (8 / num_stages)] != pp.rank()) {
        continue;
      }
      INFO("layer " << i);
      CHECK(close(full_value(model.layers[i]->weight.grad()), 2 * plain.layers[i]->weight.grad()));
      CHECK(close(full_value(model.layers[i]->bias.grad()), 2 * plain.layers[i]->bias.grad()));
    }
  }
}

// PyTorch's defaults, ported as they are: fully_shard averaging over dp (its default divide
// factor), a mean loss per microbatch and scale_grads on (the default) give the plain model's
// mean-loss gradients on the whole batch; the division runs on the sharded DTensor gradients
// after the reduce-scatter (PyTorch's wait_for_gradient_reduction), after the last B (1F1B) or
// the last W (ZBV's split backward).
TEST_CASE("scale_grads on fully_shard stages: PyTorch's defaults give the mean-loss gradients",
          "[pipelining][world4]") {
  PpDp d;
  Model plain(1);
  mean_loss(plain.run(d.input, 0, 8), d.target).backward();
  for (const Case& c : {Case{ScheduleKind::OneFOneB, 1}, Case{ScheduleKind::ZBVZeroBubble, 2}}) {
    INFO(dtensor::schedule_name(c.kind));
    const int num_stages = 2 * c.stages_per_rank;
    const auto order = dtensor::generate_schedule(c.kind, 2, kMicro, c.stages_per_rank);
    const auto placement = dtensor::validate_schedule(order, num_stages, kMicro);
    Model model(1);
    auto stages = stages_of(model, order, num_stages, kMicro, d.pp.rank());
    const auto fsdp = FullyShardOptions().mesh(d.mesh["dp"]).reshard_after_forward(false);
    for (auto& st : stages) {
      for (auto& child : st.module->children()) {
        dtensor::fully_shard(*child, fsdp);
      }
      dtensor::fully_shard(*st.module, fsdp);
    }
    dtensor::PipelineSchedule schedule(std::move(stages), d.pp, order, kMicro, mean_loss);
    schedule.step(d.my_input, d.my_target);
    for (int i = 0; i < 8; ++i) {
      if (placement[i / (8 / num_stages)] == d.pp.rank()) {
        INFO("layer " << i);
        CHECK(close(full_value(model.layers[i]->weight.grad()), plain.layers[i]->weight.grad()));
        CHECK(close(full_value(model.layers[i]->bias.grad()), plain.layers[i]->bias.grad()));
      }
    }
  }
}

// replicate() (DDP) inside stages on pp 2 x dp 2: each dp rank its half of the batch, a sum
// loss over that half's count (replicate averages over dp); the stage's weight gradients are
// all-reduced once per step, by the backward that completes them (its last B, or its last W
// for the split-backward schedules, whose W is a real backward: pytorch#144530).
TEST_CASE("replicate inside pipeline stages: one all-reduce per stage per step",
          "[pipelining][world4]") {
  PpDp d;
  const DeviceMesh& mesh = d.mesh;
  const auto& pp = d.pp;
  Model& plain = d.plain;
  auto half_loss = [](const at::Tensor& out, const at::Tensor& t) {
    return (out - t).pow(2).sum() / static_cast<double>(kBatch / 2);
  };
  for (const auto& c : kCases) {
    INFO(dtensor::schedule_name(c.kind));
    const int num_stages = 2 * c.stages_per_rank;
    auto order = dtensor::generate_schedule(c.kind, 2, kMicro, c.stages_per_rank);
    auto placement = dtensor::validate_schedule(order, num_stages, kMicro);
    Model model(1);
    auto stages = stages_of(model, order, num_stages, kMicro, pp.rank());
    std::vector<dtensor::ReplicateHandle> handles;
    for (auto& st : stages) {
      handles.push_back(dtensor::replicate(*st.module, mesh["dp"]));
      REQUIRE(handles.back().num_buckets() == 1);
    }
    dtensor::PipelineSchedule schedule(std::move(stages), pp, order, kMicro, half_loss, kSumLoss);
    CommDebugMode mode;
    schedule.step(d.my_input, d.my_target);
    CHECK(count_of(mode, "dp", CollectiveKind::AllReduce) == c.stages_per_rank);
    for (int i = 0; i < 8; ++i) {
      if (placement[i / (8 / num_stages)] == pp.rank()) {
        INFO("layer " << i);
        CHECK(close(model.layers[i]->weight.grad(), plain.layers[i]->weight.grad()));
        CHECK(close(model.layers[i]->bias.grad(), plain.layers[i]->bias.grad()));
      }
    }
  }
}

namespace {

using dtensor::models::Llama3;
using dtensor::models::Llama3Stage;

constexpr int64_t kVocab = 256;
constexpr int64_t kSeq = 8;
constexpr int64_t kSequences = 16; // the global batch

dtensor::models::Llama3Args four_layers() {
  return dtensor::models::llama3_tiny_args().n_layers(4);
}

at::Tensor token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  // A sum over the microbatch's tokens divided by the global batch's token count.
  return torch::nn::functional::cross_entropy(
             logits.reshape({-1, kVocab}), targets.reshape(-1),
             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
         static_cast<double>(kSequences * kSeq);
}

} // namespace

// The Llama recipe's model split into stages (models/llama3/pipeline.h) on 8 ranks as a 4-D
// mesh (pp, dp_replicate, dp_shard, tp): pp 2 x dp_shard 2 x tp 2, and pp 2 x HSDP 2 x 2.
// Each dp rank trains its slice of the batch; the gradients, under the whole model's names,
// equal the plain model's on the whole batch; per step each unit is all-gathered once and
// reduced once (HSDP: one all-reduce more), the P2P transfers as the schedule says.
TEST_CASE("Llama3 on pp x dp x tp: stages equal the plain model, exact counts",
          "[pipelining][world8]") {
  Llama3 plain(four_layers());
  dtensor::set_rng_state({true, 7, 0});
  plain->init_weights();
  at::manual_seed(100);
  const at::Tensor tokens = at::randint(kVocab, {kSequences, kSeq}, options(at::kLong));
  const at::Tensor targets = at::randint(kVocab, {kSequences, kSeq}, options(at::kLong));
  token_loss(plain->forward(tokens), targets).backward();
  std::map<std::string, at::Tensor> want;
  std::vector<at::Tensor> plain_grads;
  for (const auto& p : plain->named_parameters()) {
    want[p.key()] = p.value().grad();
    plain_grads.push_back(p.value().grad());
  }
  for (const auto& shape : std::vector<std::vector<int64_t>>{{2, 1, 2, 2}, {2, 2, 2, 1}}) {
    const DeviceMesh mesh =
        init_device_mesh(device_type(), shape, {"pp", "dp_replicate", "dp_shard", "tp"});
    const auto pp = mesh.get_group("pp");
    const DeviceMesh dp = mesh[{"dp_replicate", "dp_shard"}];
    const int64_t dp_rank = dp.get_local_rank(0) * dp.size(1) + dp.get_local_rank(1);
    const at::Tensor my_tokens = tokens.chunk(dp.size())[dp_rank];
    const at::Tensor my_targets = targets.chunk(dp.size())[dp_rank];
    for (auto [kind, v] :
         {std::pair{ScheduleKind::OneFOneB, 1}, {ScheduleKind::ZBVZeroBubble, 2}}) {
      INFO("mesh " << mesh.to_string() << ", " << dtensor::schedule_name(kind));
      const int num_stages = 2 * v;
      auto order = dtensor::generate_schedule(kind, 2, kMicro, v);
      auto placement = dtensor::validate_schedule(order, num_stages, kMicro);
      // Built on meta; only this rank's stages materialized, then initialized by the whole
      // model's init_weights ([Note: initializing stages built on meta]).
      Llama3 model{nullptr};
      {
        dtensor::MetaDeviceGuard meta;
        model = Llama3(four_layers());
      }
      std::vector<dtensor::PipelineStage> stages;
      int64_t units = 0; // with parameters, on this rank
      for (int s = 0; s < num_stages; ++s) {
        if (placement[s] != pp.rank()) {
          continue;
        }
        Llama3Stage stage(model, s, num_stages);
        dtensor::models::parallelize_llama3_stage(stage, mesh[{"dp_replicate", "dp_shard", "tp"}],
                                                  /*loss_parallel=*/false);
        std::set<const void*> seen; // [norm, output] is one unit of two modules
        for (auto& m : stage->modules()) {
          if (auto unit = dtensor::fsdp_module(*m)) {
            unit->set_gradient_divide_factor(1.0);
            const auto managed = unit->managed_parameters();
            if (!managed.empty() && seen.insert(managed[0].unsafeGetTensorImpl()).second) {
              ++units;
            }
          }
        }
        dtensor::to_empty(*stage, at::Device(device_type()));
        stages.push_back({s, stage.ptr(),
                          [stage](const at::Tensor& x) mutable { return stage->forward(x); },
                          mesh["tp"]}); // sequence-parallel hidden states travel as DTensors
      }
      dtensor::set_rng_state({true, 7, 0});
      model->init_weights();
      dtensor::PipelineSchedule schedule(stages, pp, order, kMicro, token_loss, kSumLoss);
      CommDebugMode mode;
      schedule.step(my_tokens, my_targets);
      const int64_t sends = p2p_per_step(placement, pp.rank(), kMicro);
      CHECK(mode.count(CollectiveKind::Send) == sends);
      CHECK(mode.count(CollectiveKind::Recv) == sends);
      CHECK(count_of(mode, "dp_shard", CollectiveKind::AllGather) == units);
      CHECK(count_of(mode, "dp_shard", CollectiveKind::ReduceScatter) == units);
      // The data-parallel mesh is 2-D, so each unit all-reduces over dp_replicate (also of
      // size 1, as FSDP x TP units on a (1, n) mesh do).
      CHECK(count_of(mode, "dp_replicate", CollectiveKind::AllReduce) == units);
      std::vector<at::Tensor> params;
      for (const auto& st : stages) {
        for (const auto& p : st.module->named_parameters()) {
          INFO("gradient of " << p.key());
          REQUIRE(want.count(p.key()) == 1); // the whole model's name
          REQUIRE(p.value().grad().defined());
          CHECK(dtensor::testing::near(full_value(p.value().grad()), want.at(p.key())));
          params.push_back(p.value());
        }
      }
      // The recipe's clipping over every stage: the plain model's total norm, one all-reduce
      // per mesh dimension of more than one rank that some gradient is sharded over (pp,
      // dp_shard, tp; never dp_replicate, where HSDP's gradients are replicated).
      CommDebugMode norm_mode;
      const at::Tensor norm = dtensor::clip_grad_norm_(params, 1e9, 2.0, false, mesh["pp"]);
      CHECK(norm_mode.count(CollectiveKind::AllReduce) ==
            1 + (mesh["dp_shard"].size() > 1 ? 1 : 0) + (mesh["tp"].size() > 1 ? 1 : 0));
      CHECK(dtensor::testing::near(full_value(norm), dtensor::get_total_norm(plain_grads)));
    }
  }
}

TEST_CASE("pipeline errors name what was wrong", "[pipelining][world2][world4]") {
  const DeviceMesh pp_mesh = init_device_mesh(device_type(), {world()}, {"pp"});
  auto pp = pp_mesh.get_group();
  auto order = dtensor::generate_schedule(ScheduleKind::OneFOneB, world(), 8);
  Model model(1);
  // Stages the schedule does not place here.
  auto mine = stages_of(model, order, world());
  mine[0].index = (rank() + 1) % world();
  REQUIRE_THROWS_WITH(dtensor::PipelineSchedule(mine, pp, order, 8, sum_loss),
                      contains("the schedule places stages [" + std::to_string(rank()) +
                               "] on pipeline rank " + std::to_string(rank()) +
                               ", but this rank was given stages [" +
                               std::to_string((rank() + 1) % world()) + "]"));
  // A norm of order 0 over stages (it counts tensors, which differ between stages), and a
  // pipeline mesh of two dimensions: refused before any collective.
  REQUIRE_THROWS_WITH(dtensor::get_total_norm({at::ones({2})}, 0.0, false, pp_mesh),
                      contains("norm_type 0 counts gradient tensors"));
  const DeviceMesh two_d = init_device_mesh(device_type(), {world(), 1}, {"pp", "x"});
  REQUIRE_THROWS_WITH(dtensor::get_total_norm({at::ones({2})}, 2.0, false, two_d),
                      contains("the pipeline mesh must be 1-D"));
  // A batch that does not split into the microbatches: checked on every rank given one,
  // agreed before any transfer, raised on every rank.
  dtensor::PipelineSchedule schedule(stages_of(model, order, world()), pp, order, 8, sum_loss);
  REQUIRE_THROWS_WITH(schedule.step(at::randn({10, kWidth}), at::randn({10, kWidth})),
                      contains("does not split into 8 microbatches along dim 0"));
  // Microbatch counts a schedule cannot take.
  REQUIRE_THROWS_WITH(
      dtensor::generate_schedule(ScheduleKind::DualPipeV, world(), 2 * world() - 1, 2),
      contains("DualPipeV: " + std::to_string(2 * world() - 1) + " microbatches for " +
               std::to_string(2 * world()) + " stages"));
  // A stage whose output shape changes at run time, on a pipeline of this rank alone (its
  // peers would otherwise wait for it): refused naming the stage, the microbatch and both
  // shapes, and the action.
  auto alone = init_device_mesh(device_type(), {world(), 1}, {"dp", "pp"}).get_group("pp");
  auto layer = std::make_shared<torch::nn::LinearImpl>(kWidth, kWidth);
  int calls = 0;
  dtensor::PipelineStage shrinking(0, layer, [&](const at::Tensor& x) {
    at::Tensor y = layer->forward(x);
    return calls++ < 2 ? y : y.narrow(0, 0, 1); // the probe and microbatch 0 keep the shape
  });
  dtensor::PipelineSchedule single(
      {shrinking}, alone, dtensor::generate_schedule(ScheduleKind::GPipe, 1, 4), 4, sum_loss);
  REQUIRE_THROWS_WITH(single.step(at::randn({8, kWidth}), at::randn({8, kWidth})),
                      contains("action 0F1") &&
                          contains("stage 0's output for microbatch 1 is Float[1, 8] but was "
                                   "Float[2, 8] on the first microbatch"));
  // finalize_backward belongs to the root unit, outside backward.
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  auto outer = std::make_shared<torch::nn::Module>();
  auto inner = outer->register_module("inner", std::make_shared<torch::nn::LinearImpl>(4, 4));
  auto inner_unit = dtensor::fully_shard(*inner, FullyShardOptions().mesh(mesh));
  dtensor::fully_shard(*outer, FullyShardOptions().mesh(mesh));
  REQUIRE_THROWS_WITH(inner_unit.finalize_backward(),
                      contains("finalize_backward: unit") && contains("is nested in unit"));
}

// [Note: sends a receive proves received] on Gloo, whose sends report completion only when
// waited for: 1F1B's first stage, whose output nothing but the runtime holds (clone saves
// nothing for backward), must have let go of every activation it has sent by the backward
// of microbatch k, microbatch k + 1's included: the gradient of k proves it received (the
// last stage posts that receive before sending the gradient), as PyTorch 2.15 waits for that
// send and releases it before its backward of k. Before, it lived through that backward.
TEST_CASE("1F1B's first stage lets go of sent activations a received gradient proves received",
          "[pipelining][world2]") {
  constexpr int kMicros = 4;
  const DeviceMesh pp_mesh = init_device_mesh(device_type(), {2}, {"pp"});
  torch::manual_seed(7);
  const at::Tensor input = at::randn({kBatch, kWidth});
  const at::Tensor target = at::randn({kBatch, kWidth});
  Model model(1);
  const auto order = dtensor::generate_schedule(ScheduleKind::OneFOneB, 2, kMicros, 1);
  auto stages = stages_of(model, order, 2, kMicros);
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> sent; // stage 0's outputs, in order
  std::string alive_during_backward;
  if (rank() == 0) {
    stages[0].forward = [&model, &sent](const at::Tensor& x) {
      at::Tensor y = model.run(x, 0, 4).clone();
      sent.push_back(y.storage().getWeakStorageImpl());
      return y;
    };
    int backwards = 0;
    model.layers[3]->weight.register_hook([&](const at::Tensor& g) {
      for (size_t mb = 0; mb < sent.size(); ++mb) {
        if (!sent[mb].expired()) {
          alive_during_backward += "forward call " + std::to_string(mb) +
                                   " during the backward of " + std::to_string(backwards) + "; ";
        }
      }
      ++backwards;
      return g;
    });
  }
  dtensor::PipelineSchedule schedule(std::move(stages), pp_mesh.get_group(), order, kMicros,
                                     sum_loss, kSumLoss);
  schedule.step(input, target);
  CHECK(alive_during_backward == "");
  if (rank() == 0) {
    CHECK(sent.size() == static_cast<size_t>(kMicros) + 1); // + finding the shapes on meta
  }
  Model plain(1);
  sum_loss(plain.run(input, 0, 8), target).backward();
  for (int i = rank() * 4; i < rank() * 4 + 4; ++i) {
    CHECK(close(model.layers[i]->weight.grad(), plain.layers[i]->weight.grad()));
  }
}
