// The module seam (dtensor/module_hooks.h): hooks run as nested scopes in their order around
// dtensor::call, inputs and outputs replaced by them, an around hook that runs forward again
// in backward (activation checkpointing applied from outside), pre-backward once per call,
// errors, removal; and a tensor-parallel MLP called through the seam against the plain MLP
// (values, gradients, exact collective counts). One process for the seam's own logic; the
// tensor-parallel case on 2 and 4 ranks.
#include <string>
#include <vector>

#include <models/common_dtensor.h>

#include "support/prelude.h"

namespace {

using dtensor::ModuleHooks;
using dtensor::TensorList;

struct TwoInImpl : torch::nn::Module {
  TwoInImpl() : lin(register_module("lin", torch::nn::Linear(3, 3))) {}
  // A tensor, a non-tensor and an optional tensor in; a tuple of a tensor and an int out.
  std::tuple<at::Tensor, int64_t> forward(const at::Tensor& x, double scale,
                                          const std::optional<at::Tensor>& bias) {
    ++forwards;
    at::Tensor y = lin->forward(x) * scale;
    return {bias ? y + *bias : y, forwards};
  }
  torch::nn::Linear lin;
  int64_t forwards = 0;
};
TORCH_MODULE(TwoIn);

ModuleHooks logging(std::vector<std::string>& log, const std::string& name, int order) {
  return ModuleHooks()
      .name(name)
      .order(order)
      .pre_forward([&log, name](torch::nn::Module&, TensorList&) { log.push_back(name + ".pre"); })
      .post_forward(
          [&log, name](torch::nn::Module&, TensorList&) { log.push_back(name + ".post"); });
}

} // namespace

TEST_CASE("module seam: hooks nest in their order, global ones first at equal order",
          "[module_hooks][world1]") {
  TwoIn m;
  std::vector<std::string> log;
  auto h1 = dtensor::register_module_hooks(*m, logging(log, "b", 200));
  auto h2 = dtensor::register_module_hooks(*m, logging(log, "a", 100));
  auto h3 = dtensor::register_module_hooks(*m, logging(log, "c", 200));
  auto g = dtensor::register_global_module_hooks(logging(log, "g", 200));
  const at::Tensor x = at::ones({2, 3});
  auto [y, n] = dtensor::call(m, x, 2.0, std::optional<at::Tensor>());
  CHECK(n == 1);
  CHECK(log == std::vector<std::string>{"a.pre", "g.pre", "b.pre", "c.pre", "c.post", "b.post",
                                        "g.post", "a.post"});
  CHECK(dtensor::module_hook_names(*m) ==
        std::vector<std::string>{"CommDebugMode", "a", "g", "b", "c"});
  g.remove();
  h1.remove();
  h1.remove(); // idempotent
  log.clear();
  dtensor::call(m, x, 2.0, std::optional<at::Tensor>());
  CHECK(log == std::vector<std::string>{"a.pre", "c.pre", "c.post", "a.post"});
  h2.remove();
  h3.remove();
  CHECK(dtensor::module_hook_names(*m) == std::vector<std::string>{"CommDebugMode"});
}

TEST_CASE("module seam: hooks replace inputs and outputs; non-tensor arguments pass through",
          "[module_hooks][world1]") {
  TwoIn m;
  const at::Tensor x = at::randn({2, 3});
  const at::Tensor bias = at::randn({3});
  const at::Tensor plain = m->lin->forward(x + 1) * 3.0 + bias;
  // The pre-forward hook sees [x, bias] (the double is not a tensor) and shifts x; the
  // post-forward hook sees the tuple's tensor only and doubles it.
  std::vector<size_t> seen;
  auto h = dtensor::register_module_hooks(
      *m, ModuleHooks()
              .name("shift")
              .pre_forward([&](torch::nn::Module&, TensorList& in) {
                seen.push_back(in.size());
                in[0] = in[0] + 1;
              })
              .post_forward([&](torch::nn::Module&, TensorList& out) {
                seen.push_back(out.size());
                out[0] = out[0] * 2;
              }));
  auto [y, n] = dtensor::call(m, x, 3.0, std::optional<at::Tensor>(bias));
  CHECK(seen == std::vector<size_t>{2, 1});
  CHECK(n == 1);
  CHECK(at::allclose(y, plain * 2));
  // A hook may not change the number of tensors ("module hooks 'dropper' on ...TwoInImpl").
  auto bad = dtensor::register_module_hooks(
      *m, ModuleHooks().name("dropper").pre_forward(
              [](torch::nn::Module&, TensorList& in) { in.pop_back(); }));
  REQUIRE_THROWS_WITH(dtensor::call(m, x, 3.0, std::optional<at::Tensor>(bias)),
                      contains("TwoInImpl: pre_forward left 1 inputs, the call has 2"));
}

TEST_CASE("module seam: forward_failed undoes what outer hooks began; the error reaches the caller",
          "[module_hooks][world1]") {
  TwoIn m;
  std::vector<std::string> log;
  auto outer = dtensor::register_module_hooks(
      *m, logging(log, "outer", 10).forward_failed([&](torch::nn::Module&) {
        log.push_back("outer.failed");
      }));
  auto inner = dtensor::register_module_hooks(
      *m, ModuleHooks().name("inner").order(20).post_forward([](torch::nn::Module&, TensorList&) {
        throw std::runtime_error("inner post_forward failed");
      }));
  REQUIRE_THROWS_WITH(dtensor::call(m, at::ones({1, 3}), 1.0, std::optional<at::Tensor>()),
                      "inner post_forward failed");
  CHECK(log == std::vector<std::string>{"outer.pre", "outer.failed"});
}

TEST_CASE("module seam: pre-backward fires once per call, at the first output gradient",
          "[module_hooks][world1]") {
  torch::nn::Linear lin(4, 4);
  int fired = 0;
  auto h = dtensor::register_module_hooks(
      *lin, ModuleHooks().name("count").pre_backward([&](torch::nn::Module&) { ++fired; }));
  for (int step = 1; step <= 2; ++step) {
    at::Tensor y = dtensor::call(lin, at::randn({2, 4}));
    // Two uses of the output, so two gradients arrive for it: one hook call.
    (y.sum() + y.pow(2).sum()).backward();
    CHECK(fired == step);
  }
  // Outputs that need no gradient register nothing.
  {
    torch::NoGradGuard no_grad;
    dtensor::call(lin, at::randn({2, 4}));
  }
  CHECK(fired == 2);
}

TEST_CASE("module seam: checkpoint_module recomputes the forward and the hooks inside it only",
          "[module_hooks][activation_checkpoint][world1]") {
  dtensor::models::MLPModule ref, m; // the same parameters (seed 5)
  int outside = 0, inside = 0;
  auto count = [](int& n, int order) {
    return ModuleHooks().name("count").order(order).pre_forward(
        [&n](torch::nn::Module&, TensorList&) { ++n; });
  };
  auto a = dtensor::register_module_hooks(*m, count(outside, dtensor::hook_order::kFullyShard));
  auto b = dtensor::register_module_hooks(*m, count(inside, dtensor::hook_order::kTensorParallel));
  auto c = dtensor::checkpoint_module(*m);
  const at::Tensor x = at::randn({4, 10});
  at::Tensor y = dtensor::call(m, x);
  CHECK((outside == 1 && inside == 1));
  y.pow(2).sum().backward();
  CHECK((outside == 1 && inside == 2)); // the recompute ran the inner hook again
  ref->forward(x).pow(2).sum().backward();
  for (size_t i = 0; i < ref->parameters().size(); ++i) {
    CHECK(at::allclose(m->parameters()[i].grad(), ref->parameters()[i].grad()));
  }
}

TEST_CASE("module seam: hooks of a freed module are not inherited at its address",
          "[module_hooks][world1]") {
  std::vector<std::string> log;
  const void* address = nullptr;
  {
    torch::nn::Linear a(2, 2);
    address = a.get();
    dtensor::register_module_hooks(*a, logging(log, "a", 1));
  }
  torch::nn::Linear b(2, 2);
  INFO("same address: " << (b.get() == address));
  dtensor::call(b, at::ones({1, 2}));
  CHECK(log.empty());
  CHECK(dtensor::module_hook_names(*b) == std::vector<std::string>{"CommDebugMode"});
}

TEST_CASE("module seam: a tensor-parallel MLP called through the seam equals the plain MLP, "
          "with one all-reduce forward and none backward",
          "[module_hooks][world2][world4]") {
  dtensor::models::MLPModule ref, m; // the same parameters (seed 5)
  auto mesh = init_device_mesh(c10::kCPU, {world()}, {"tp"});
  dtensor::parallelize_module(*m, mesh,
                              {{"net1", std::make_shared<dtensor::ColwiseParallel>()},
                               {"net2", std::make_shared<dtensor::RowwiseParallel>()}});
  CHECK(dtensor::module_hook_names(*m->net1) ==
        std::vector<std::string>{"CommDebugMode", "tensor parallelism"});
  at::manual_seed(7); // the same input on every rank
  const at::Tensor x = at::randn({4, 10});
  at::Tensor y;
  {
    CommDebugMode comms;
    y = dtensor::call(m, x);
    // net2's Partial -> Replicate at its boundary; RowwiseParallel's use_local_output.
    CHECK(comms.count(CollectiveKind::AllReduce) == 1);
    CHECK_FALSE(dtensor::is_dtensor(y));
    y.sum().backward();
    CHECK(comms.total_count() == 1); // the input needs no gradient: nothing to reduce
  }
  const at::Tensor want = ref->forward(x);
  CHECK(close(y, want));
  want.sum().backward();
  const at::Tensor g1 = dtensor::DTensor(m->net1->weight.grad()).full_tensor();
  CHECK(close(g1, ref->net1->weight.grad()));
}

namespace {

// An input layer held by the root, then two blocks: fully_shard units each, the root a unit.
struct BlocksImpl : torch::nn::Module {
  explicit BlocksImpl(bool through_seam) : seam(through_seam) {
    torch::manual_seed(3);
    in = register_module("in", torch::nn::Linear(6, 8));
    blocks = register_module(
        "blocks", torch::nn::ModuleList(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)));
  }
  at::Tensor forward(at::Tensor x) {
    x = seam ? dtensor::call(in, x) : in->forward(x);
    for (const auto& b : *blocks) {
      auto* lin = b->as<torch::nn::LinearImpl>();
      x = at::relu(seam ? dtensor::call(*lin, x) : lin->forward(x));
    }
    return x;
  }
  bool seam;
  torch::nn::Linear in{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Blocks);

} // namespace

TEST_CASE("module seam: fully_shard's events; one pre-backward and one backward all-gather per "
          "unit and backward; without the seam the ops drive the units",
          "[module_hooks][fully_shard][world1][world2][world4]") {
  auto dp = init_device_mesh(c10::kCPU, {world()}, {"dp"});
  for (bool seam : {true, false}) {
    INFO("through the seam: " << seam);
    Blocks model(seam), plain(seam);
    for (const auto& b : *model->blocks) {
      dtensor::fully_shard(*b, FullyShardOptions().mesh(dp));
    }
    dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
    int pre_backwards = 0;
    std::vector<dtensor::HookHandle> handles;
    for (const auto& b : *model->blocks) {
      handles.push_back(dtensor::register_module_hooks(
          *b,
          ModuleHooks().name("count").pre_backward([&](torch::nn::Module&) { ++pre_backwards; })));
    }
    for (int step = 0; step < 2; ++step) {
      at::manual_seed(100 + step * 7 + rank());
      const at::Tensor x = at::randn({3, 6});
      CommDebugMode mode;
      at::Tensor loss = dtensor::call(model, x).pow(2).sum();
      CHECK(mode.count(CollectiveKind::AllGather) == over(world(), 3)); // one per unit
      loss.backward();
      // Through the seam the last block reshards at its exit (FSDP2) and is gathered again in
      // backward, as the first one is; driven by the ops it stays unsharded until backward.
      CHECK(mode.count(CollectiveKind::AllGather) == over(world(), 3 + (seam ? 2 : 1)));
      CHECK(mode.count(CollectiveKind::ReduceScatter) == over(world(), 3));
      CHECK(pre_backwards == (seam ? 2 * (step + 1) : 0));
      // The plain model on every rank's batch: fully_shard averages over the ranks.
      for (int r = 0; r < world(); ++r) {
        at::manual_seed(100 + step * 7 + r);
        (plain->forward(at::randn({3, 6})).pow(2).sum() / world()).backward();
      }
      auto p = model->parameters();
      auto q = plain->parameters();
      for (size_t i = 0; i < p.size(); ++i) {
        CHECK(close(full_value(p[i].grad()), q[i].grad()));
      }
    }
  }
}
