// Loss parallelism: cross_entropy on class-sharded logits under LossParallel,
// judged against the plain op on the whole logits (value and gradient), with exact
// collective counts and sizes: nothing of size N x C is ever communicated.
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>

#include "support/prelude.h"

namespace F = torch::nn::functional;
using dtensor::LossParallel;

namespace {

constexpr int64_t kRows = 12;
constexpr int64_t kClasses = 10; // uneven over 4 ranks: 3, 3, 3, 1

at::Tensor logits_value() {
  at::manual_seed(11);
  return at::randn({kRows, kClasses}, options()) * 3;
}

at::Tensor target_value() {
  at::manual_seed(12);
  at::Tensor t = at::randint(kClasses, {kRows}, options(at::kLong));
  t[2] = -100; // ignored rows
  t[7] = -100;
  return t;
}

at::Tensor class_weights() {
  return at::linspace(0.5, 1.5, kClasses, options());
}

// A leaf DTensor holding `value` in `placements`, and its plain twin.
struct Logits {
  at::Tensor dist;
  at::Tensor plain;
};

Logits make_logits(const DeviceMesh& mesh, const Placements& placements) {
  Logits l;
  l.plain = logits_value().requires_grad_(true);
  l.dist = dtensor::distribute_tensor(logits_value(), mesh, placements);
  l.dist.requires_grad_(true);
  return l;
}

F::CrossEntropyFuncOptions ce_options(int reduction, bool weighted) {
  F::CrossEntropyFuncOptions o;
  if (reduction == 0) {
    o.reduction(torch::kNone);
  } else if (reduction == 2) {
    o.reduction(torch::kSum);
  }
  if (weighted) {
    o.weight(class_weights());
  }
  return o;
}

int64_t all_reduce_numel(const CommDebugMode& mode, size_t i) {
  std::vector<int64_t> sizes;
  for (const auto& r : mode.records()) {
    if (r.kind == CollectiveKind::AllReduce) {
      int64_t n = 1;
      for (int64_t s : r.shape) {
        n *= s;
      }
      sizes.push_back(n);
    }
  }
  return sizes.at(i);
}

// On (dp=2, tp=2): logits Shard(0) on dp, Shard(1) on tp; the target Shard(0) on dp.
struct DpTp {
  DeviceMesh mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
  Logits l = make_logits(mesh, {Placement::shard(0), Placement::shard(1)});
  at::Tensor target_plain = target_value();
  at::Tensor target =
      dtensor::distribute_tensor(target_plain, mesh, {Placement::shard(0), Placement::replicate()});
};

} // namespace

TEST_CASE("loss parallel: cross_entropy on class-sharded logits, 1-D mesh",
          "[loss_parallel][world1][world2][world4]") {
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  const int64_t g = world();
  for (int reduction : {0, 1, 2}) {
    for (bool weighted : {false, true}) {
      INFO("reduction " << reduction << " weighted " << weighted);
      Logits l = make_logits(tp, {Placement::shard(1)});
      at::Tensor target = target_value();
      at::Tensor want = F::cross_entropy(l.plain, target, ce_options(reduction, weighted));
      want.sum().backward();

      LossParallel scope;
      CommDebugMode forward;
      at::Tensor loss = F::cross_entropy(l.dist, target, ce_options(reduction, weighted));
      // Two all-reduces of N = 12 elements (row max, row sum of exponentials), then the
      // loss: a scalar, or N values with reduction none. No all-gather.
      REQUIRE(forward.count(CollectiveKind::AllReduce) == over(g, 3));
      REQUIRE(forward.total_count() == over(g, 3));
      if (g > 1) {
        REQUIRE(all_reduce_numel(forward, 0) == kRows);
        REQUIRE(all_reduce_numel(forward, 1) == kRows);
        REQUIRE(all_reduce_numel(forward, 2) == (reduction == 0 ? kRows : 1));
      }
      REQUIRE(DTensor(loss).placements() == Placements{Placement::replicate()});
      REQUIRE(close(full_value(loss), want));

      CommDebugMode backward;
      loss.sum().backward();
      REQUIRE(backward.total_count() == 0);
      REQUIRE(DTensor(l.dist.grad()).placements() == Placements{Placement::shard(1)});
      REQUIRE(close(full_value(l.dist.grad()), l.plain.grad()));
    }
  }
}

TEST_CASE("loss parallel: batch sharded on dp, classes on tp; mean is the global mean",
          "[loss_parallel][world4]") {
  DpTp j;
  Logits& l = j.l;
  at::Tensor want = F::cross_entropy(l.plain, j.target_plain, ce_options(1, true));
  want.backward();

  LossParallel scope;
  CommDebugMode forward;
  at::Tensor loss = F::cross_entropy(l.dist, j.target, ce_options(1, true));
  // tp: row max, row sum, the loss; dp: the pair (loss sum, weight total) for the mean.
  REQUIRE(forward.count(CollectiveKind::AllReduce) == 4);
  REQUIRE(forward.total_count() == 4);
  REQUIRE(all_reduce_numel(forward, 0) == kRows / 2);
  REQUIRE(all_reduce_numel(forward, 3) == 2);
  REQUIRE(close(full_value(loss), want));
  CommDebugMode backward;
  loss.backward();
  REQUIRE(backward.total_count() == 0);
  REQUIRE(close(full_value(l.dist.grad()), l.plain.grad()));

  // A plain target cannot say how the batch is split.
  REQUIRE_THROWS_WITH(F::cross_entropy(l.dist, j.target_plain),
                      contains("target is a plain tensor") && contains("(Shard(0), Replicate())"));
}

TEST_CASE("loss parallel: reduction sum leaves the batch mesh dim Partial",
          "[loss_parallel][world4]") {
  DpTp j;
  Logits& l = j.l;
  at::Tensor want = F::cross_entropy(l.plain, j.target_plain, ce_options(2, false));
  want.backward();
  LossParallel scope;
  CommDebugMode mode;
  at::Tensor loss = F::cross_entropy(l.dist, j.target, ce_options(2, false));
  REQUIRE(mode.count(CollectiveKind::AllReduce) == 3); // over tp only
  REQUIRE(DTensor(loss).placements() ==
          Placements{Placement::partial(ReduceOp::Sum), Placement::replicate()});
  REQUIRE(close(full_value(loss), want));
  loss.backward();
  REQUIRE(close(full_value(l.dist.grad()), l.plain.grad()));
}

TEST_CASE("loss parallel: log-probabilities used twice still get the right gradient",
          "[loss_parallel][world1][world2][world4]") {
  // PyTorch's loss_parallel hands the logits' gradient through log_softmax's backward, which
  // is wrong once the log-probabilities feed another op as well; here the sum of gradients
  // carries no tag, and log_softmax's backward all-reduces its row sums instead.
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  const int64_t g = world();
  Logits l = make_logits(tp, {Placement::shard(1)});
  at::Tensor target = target_value();
  auto both = [&](const at::Tensor& logits) {
    at::Tensor lp = F::log_softmax(logits, F::LogSoftmaxFuncOptions(1));
    return F::nll_loss(lp, target) + lp.exp().pow(2).sum() * 0.01;
  };
  both(l.plain).backward();
  LossParallel scope;
  at::Tensor loss = both(l.dist);
  REQUIRE(close(full_value(loss), both(l.plain.detach())));
  CommDebugMode backward;
  loss.backward();
  REQUIRE(backward.count(CollectiveKind::AllReduce) == over(g, 1)); // the row sums
  REQUIRE(backward.count(CollectiveKind::AllGather) == 0);
  REQUIRE(close(full_value(l.dist.grad()), l.plain.grad()));
}

TEST_CASE("loss parallel: the class dim sharded twice is refused, naming the layout",
          "[loss_parallel][world4]") {
  auto mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
  Logits l = make_logits(mesh, {Placement::shard(1), Placement::shard(1)});
  LossParallel scope;
  REQUIRE_THROWS_WITH(F::cross_entropy(l.dist, target_value()),
                      contains("aten::_log_softmax under LossParallel") &&
                          contains("exactly one") && contains("(Shard(1), Shard(1))"));
}

TEST_CASE("loss parallel: without the scope the logits are gathered (same values)",
          "[loss_parallel][world2][world4]") {
  auto tp = init_device_mesh(device_type(), {world()}, {"tp"});
  Logits l = make_logits(tp, {Placement::shard(1)});
  at::Tensor target = target_value();
  at::Tensor want = F::cross_entropy(l.plain, target);
  // Outside the scope a plain target does not mix with DTensors (nor in PyTorch).
  REQUIRE_THROWS_WITH(F::cross_entropy(l.dist, target), contains("mixes DTensors with plain"));
  CommDebugMode mode;
  at::Tensor loss =
      F::cross_entropy(l.dist, dtensor::distribute_tensor(target, tp, {Placement::replicate()}));
  REQUIRE(mode.count(CollectiveKind::AllGather) == 1); // the N x C logits
  REQUIRE(close(full_value(loss), want));
}
