// Pipeline parallelism (include/dtensor/pipelining.h): every schedule trains a small model
// cut into stages on 2 and 4 pipeline ranks; losses and every parameter's gradient equal the
// plain model's on one process (fp32, atol 1e-6), for a sum loss over the global count and a
// mean loss; each rank's point-to-point transfers are counted exactly (one send of each
// activation and one of each input gradient across every stage boundary between ranks, per
// microbatch); bad input is refused naming what was wrong.
#include <torch/nn/modules/linear.h>

#include <dtensor/pipelining.h>

#include "support/prelude.h"

using dtensor::PipelineOrder;
using dtensor::ScheduleKind;

namespace {

constexpr int kWidth = 8;
constexpr int kBatch = 16;

// The model: 8 layers of Linear + tanh, the last without tanh; each stage holds
// 8 / num_stages consecutive layers.
struct Model {
  std::vector<torch::nn::Linear> layers;

  explicit Model(int seed) {
    torch::manual_seed(seed);
    for (int i = 0; i < 8; ++i) {
      layers.emplace_back(kWidth, kWidth);
    }
  }

  at::Tensor run(at::Tensor x, int from, int to) {
    for (int i = from; i < to; ++i) {
      x = layers[i]->forward(x);
      if (i != 7) {
        x = at::tanh(x);
      }
    }
    return x;
  }
};

at::Tensor sum_loss(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).sum() / static_cast<double>(kBatch); // over the global count
}

at::Tensor mean_loss(const at::Tensor& out, const at::Tensor& target) {
  return (out - target).pow(2).mean();
}

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

// This rank's stages of `model`, as the schedule places them.
std::vector<dtensor::PipelineStage> stages_of(Model& model, const PipelineOrder& order,
                                              int num_stages) {
  auto placement = dtensor::validate_schedule(order, num_stages, 8);
  int per = 8 / num_stages;
  std::vector<dtensor::PipelineStage> out;
  for (int s = 0; s < num_stages; ++s) {
    if (placement[s] != rank()) {
      continue;
    }
    auto holder = std::make_shared<torch::nn::Module>();
    for (int i = s * per; i < (s + 1) * per; ++i) {
      holder->register_module("layer" + std::to_string(i), model.layers[i]);
    }
    out.push_back({s, holder, [&model, s, per](const at::Tensor& x) {
                     return model.run(x, s * per, (s + 1) * per);
                   }});
  }
  return out;
}

} // namespace

TEST_CASE("every schedule's gradients equal the plain model's", "[pipelining][world2][world4]") {
  auto pp = init_device_mesh(device_type(), {world()}, {"pp"}).get_group();
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
      dtensor::PipelineSchedule schedule(stages_of(model, order, num_stages), pp, order, 8,
                                         mean ? mean_loss : sum_loss,
                                         dtensor::PipelineOptions().mean_over_microbatches(mean));
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
    }
  }
}

TEST_CASE("pipeline errors name what was wrong", "[pipelining][world2][world4]") {
  auto pp = init_device_mesh(device_type(), {world()}, {"pp"}).get_group();
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
  // A batch that does not split into the microbatches (checked before any transfer).
  dtensor::PipelineSchedule schedule(stages_of(model, order, world()), pp, order, 8, sum_loss);
  if (rank() == 0 || rank() == world() - 1) {
    REQUIRE_THROWS_WITH(schedule.step(at::randn({10, kWidth}), at::randn({10, kWidth})),
                        contains("does not split into 8 microbatches along dim 0"));
  }
  // Microbatch counts a schedule cannot take.
  REQUIRE_THROWS_WITH(
      dtensor::generate_schedule(ScheduleKind::DualPipeV, world(), 2 * world() - 1, 2),
      contains("DualPipeV: " + std::to_string(2 * world() - 1) + " microbatches for " +
               std::to_string(2 * world()) + " stages"));
}
