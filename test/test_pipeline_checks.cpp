// Pipelining's checks across ranks ([Note: agreeing before the first step] and [Note: a bad
// batch on a later step] in lib/parallel/pipelining/runtime.cpp), on the two ranks a user's
// probe showed the faults on. Guards: a batch that does not split (ZBV, 30 rows, 8
// microbatches) and ranks built with different stage counts (1F1B with 2 stages against
// Interleaved 1F1B with 4) raise the same error on every rank before any transfer, where one
// rank used to fail alone and the other wait for it; a failure in the first step's shape
// exchange, and a peer's wait on a rank whose later batch did not split, name the pipeline
// rank, the stage and the action. Each runs on a pipeline group of its own with a short
// timeout, so that a regression fails in seconds instead of hanging.
#include <chrono>
#include <functional>
#include <stdexcept>

#include <torch/nn/modules/linear.h>

#include <dtensor/pipelining.h>

#include "mesh/agree.h"
#include "pipelining/small_model.h"
#include "support/prelude.h"

using dtensor::ScheduleKind;
using namespace pipeline_test;

namespace {

// A pipeline group over both ranks with a timeout of `seconds`, made once the ranks are
// together (so that its rendezvous does not wait on a slow peer).
dtensor::Group short_group(const std::string& name, int seconds) {
  dtensor::barrier(dtensor::world_group());
  return dtensor::new_group(
      {0, 1}, name, dtensor::GroupOptions().timeout(std::chrono::seconds(seconds)).name(name));
}

// What `body` raised ("" if nothing).
std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Whether every rank holds the same text (gathered over the world, which stays healthy).
bool same_on_every_rank(const std::string& text) {
  for (const auto& other : dtensor::detail::all_gather_strings(text, dtensor::world_group())) {
    if (other != text) {
      return false;
    }
  }
  return true;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

} // namespace

// ZBV on 2 ranks places stages 0 and 3 on rank 0, 1 and 2 on rank 1: rank 1 reads no batch,
// so it used to skip the check and wait in the shape exchange until rank 0's process ended.
TEST_CASE("a batch that does not split raises the same error on every rank",
          "[pipelining][world2]") {
  const dtensor::Group pp = short_group("pp-batch", 10);
  const auto order = dtensor::generate_schedule(ScheduleKind::ZBVZeroBubble, 2, 8, 2);
  Model model(1);
  dtensor::PipelineSchedule schedule(stages_of(model, order, 4, 8, pp.rank()), pp, order, 8,
                                     mean_loss);
  const std::string bad = " (Float[30, 8] on cpu) does not split into 8 microbatches along dim 0";
  const std::string head = "PipelineSchedule::step on " + pp.to_string() +
                           ": the batch does not split into the 8 microbatches, so nothing was "
                           "sent: pipeline rank 0 (stages [0, 3]): the input" +
                           bad + "; the target" + bad;
  // Both ranks given the batch, as a user's loop does: each checks its own.
  const at::Tensor rows30 = at::randn({30, kWidth});
  const auto start = std::chrono::steady_clock::now();
  CHECK(error_of([&] { schedule.step(rows30, rows30); }) ==
        head + "; pipeline rank 1 (stages [1, 2]): the input" + bad + "; the target" + bad);
  CHECK(seconds_since(start) < 5); // at once, not at the group's timeout
  // Rank 1 given none: it contributes nothing and raises rank 0's error all the same.
  const bool reads = pp.rank() == 0;
  CHECK(error_of([&] {
          schedule.step(reads ? rows30 : at::Tensor(), reads ? rows30 : at::Tensor());
        }) == head);
  // The schedule is left usable: 32 rows give the plain model's mean-loss gradients
  // (PyTorch's default, scale_grads).
  torch::manual_seed(7);
  const at::Tensor input = at::randn({32, kWidth});
  const at::Tensor target = at::randn({32, kWidth});
  schedule.step(reads ? input : at::Tensor(), reads ? target : at::Tensor());
  Model plain(1);
  mean_loss(plain.run(input, 0, 8), target).backward();
  const auto placement = dtensor::validate_schedule(order, 4, 8);
  for (int i = 0; i < 8; ++i) {
    if (placement[i / 2] == pp.rank()) {
      INFO("layer " << i);
      CHECK(close(model.layers[i]->weight.grad(), plain.layers[i]->weight.grad()));
      CHECK(close(model.layers[i]->bias.grad(), plain.layers[i]->bias.grad()));
    }
  }
}

// Each rank's order is valid on its own (1F1B's stage 0 of 2; Interleaved 1F1B's stages 1
// and 3 of 4): they used to wait for each other's transfers until the collective timeout.
TEST_CASE("ranks built with different stage counts fail together, at once",
          "[pipelining][world2]") {
  const dtensor::Group pp = short_group("pp-stages", 10);
  const bool first = pp.rank() == 0;
  const auto order = first ? dtensor::generate_schedule(ScheduleKind::OneFOneB, 2, 8, 1)
                           : dtensor::generate_schedule(ScheduleKind::Interleaved1F1B, 2, 8, 2);
  Model model(1);
  dtensor::PipelineSchedule schedule(stages_of(model, order, first ? 2 : 4, 8, pp.rank()), pp,
                                     order, 8, mean_loss);
  const at::Tensor batch = at::randn({kBatch, kWidth});
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of([&] { schedule.step(batch, batch); });
  CHECK(seconds_since(start) < 5);
  CHECK_THAT(error, contains("PipelineSchedule::step on " + pp.to_string() +
                             ": the pipeline ranks were built with different schedules, so "
                             "nothing was sent: pipeline rank 0 (stages [0]): 2 stages, 8 "
                             "microbatches, program #") &&
                        contains("; pipeline rank 1 (stages [1, 3]): 4 stages, 8 microbatches, "
                                 "program #"));
  CHECK(same_on_every_rank(error));
}

// Rank 0's stage fails in the first step's forward of microbatch 0 (the shape probe); rank 1
// waits for the shape it would have sent, until the group's timeout (2 s).
TEST_CASE("a failure in the first step's shape exchange names the rank, stage and action",
          "[pipelining][world2]") {
  const dtensor::Group pp = short_group("pp-shapes", 2);
  auto layer = std::make_shared<torch::nn::LinearImpl>(kWidth, kWidth);
  const int me = pp.rank();
  dtensor::PipelineStage stage(me, layer, [&layer, me](const at::Tensor& x) {
    if (me == 0) {
      throw std::runtime_error("stage 0 fails on purpose");
    }
    return layer->forward(x);
  });
  dtensor::PipelineSchedule schedule(
      {stage}, pp, dtensor::generate_schedule(ScheduleKind::OneFOneB, 2, 4), 4, sum_loss, kSumLoss);
  const at::Tensor batch = at::randn({8, kWidth});
  const std::string error = error_of([&] { schedule.step(batch, batch); });
  const std::string who = "pipeline rank " + std::to_string(me) + " (" + pp.to_string() + ")";
  if (me == 0) {
    CHECK(error == who + ", stage 0, the first step's shape exchange (its forward of microbatch "
                         "0): stage 0 fails on purpose");
  } else {
    CHECK_THAT(error, contains(who + ", stage 1, the first step's shape exchange (receiving its "
                                     "input's shape from pipeline rank 0 (stage 0), which failed "
                                     "or is late): recv("));
  }
}

// [Note: a bad batch on a later step]: no collective; the rank with the bad batch raises at
// once, its peer fails in its receive, naming itself, its stage and action, and the peer it
// waited for (at the group's timeout here, 2 s, since rank 0's process lives on).
TEST_CASE("a later step's bad batch: the waiting rank names the one that failed",
          "[pipelining][world2]") {
  const dtensor::Group pp = short_group("pp-later", 2);
  const auto order = dtensor::generate_schedule(ScheduleKind::OneFOneB, 2, 4);
  Model model(1);
  dtensor::PipelineSchedule schedule(stages_of(model, order, 2, 4, pp.rank()), pp, order, 4,
                                     sum_loss, kSumLoss);
  const at::Tensor batch = at::randn({kBatch, kWidth});
  schedule.step(batch, batch);
  const bool first = pp.rank() == 0;
  const std::string error = error_of([&] {
    schedule.step(first ? at::randn({30, kWidth}) : batch, batch);
  });
  const std::string who =
      "pipeline rank " + std::to_string(pp.rank()) + " (" + pp.to_string() + ")";
  if (first) {
    CHECK(error == "PipelineSchedule::step: " + who +
                       ", stages [0], before the step's first transfer: the input (Float[30, 8] "
                       "on cpu) does not split into 4 microbatches along dim 0");
  } else {
    CHECK_THAT(error, contains(who + ", stage 1, action 1F0 (step ") &&
                          contains(" of its program): waiting for the input of microbatch 0 from "
                                   "pipeline rank 0 (stage 0), which failed or is late: recv("));
  }
}
