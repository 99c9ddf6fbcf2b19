// Float8 linears (include/dtensor/float8.h, docs/float8.md). Their numerics are judged by
// torchao itself in test/float8/torchao_judge.py (bit-equal for every recipe); here:
//  - world1: refusals, each naming what was wrong: an unknown recipe, a Linear converted twice,
//    a DTensor input (tensor parallelism), an input that does not fit the weight; the filter
//    (torchtitan's: not the output, features multiples of 16).
//  - world2: a converted module under fully_shard equals, on each rank's rows, the same module
//    converted on one process (its float8 products with the rank's own input scales), the
//    gradients averaged over the ranks; every recipe; 1 all-gather per unit and call, 1
//    reduce-scatter per unit in backward (the float8 products add no collective).
//  - world2 / world4: tensor parallelism (ColwiseParallel w1, w3 with a Shard(0) bias;
//    RowwiseParallel w2 with a Replicate bias) equals the converted FFN on one process, every
//    recipe; its collectives are the bf16 TP FFN's plus the amax all-reduces of
//    [Note: float8 under tensor parallelism]; under activation checkpointing the same bits; on 4
//    ranks also under fully_shard (dp 2 x tp 2).
//  - world2: an MoE layer's experts converted to float8 (float8_grouped_mm, judged by torchao in
//    float8_torchao) under expert parallelism equal the converted layer on one process on each
//    rank's rows, every gradient; the all-to-alls are the bf16 layer's (3 forward, 2 backward).
//  - world2 / world4: fully_shard's float8 all-gather, with an even (64 rows), an uneven and,
//    on 4 ranks, an empty shard (3 rows): outputs and gradients equal the float8 model without
//    it, bit for bit, over two optimizer steps; all-gather bytes exactly half the bf16 run's;
//    without precompute one amax all-reduce per unit, with it exactly one per step; the
//    unsharded weight kept as the gathered float8 bits (a byte an element).
#include <dtensor/activation_checkpoint.h>
#include <dtensor/expert_parallel.h>
#include <dtensor/float8.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <models/moe/float8.h>
#include <models/moe/moe.h>

#include "support/prelude.h"

using dtensor::Float8LinearOptions;
using dtensor::Float8Recipe;
using dtensor::testing::near;

namespace {

struct TwoLinearsImpl : torch::nn::Module {
  explicit TwoLinearsImpl(int64_t in = 32, int64_t hidden = 64, int64_t out = 10)
      : proj(register_module("proj",
                             torch::nn::Linear(torch::nn::LinearOptions(in, hidden).bias(false)))),
        output(register_module(
            "output", torch::nn::Linear(torch::nn::LinearOptions(hidden, out).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) {
    return dtensor::call(output, at::relu(dtensor::call(proj, x)));
  }
  torch::nn::Linear proj;
  torch::nn::Linear output;
};
TORCH_MODULE(TwoLinears);

TwoLinears seeded(Float8Recipe recipe) {
  at::manual_seed(5);
  TwoLinears m;
  dtensor::convert_to_float8_training(*m, Float8LinearOptions().recipe(recipe),
                                      dtensor::float8_skip_output_and_unaligned);
  return m;
}

} // namespace

TEST_CASE("float8: refusals name the recipe, the Linear, the DTensor input and the shapes; "
          "torchtitan's filter",
          "[world1]") {
  CHECK_THROWS_WITH(dtensor::float8_recipe_from_name("rowwize"),
                    Catch::Contains("unknown recipe 'rowwize'") &&
                        Catch::Contains("tensorwise, rowwise, rowwise_with_gw_hp"));
  CHECK(dtensor::float8_recipe_from_name("rowwise_with_gw_hp") == Float8Recipe::RowwiseWithGwHp);
  TwoLinears m = seeded(Float8Recipe::Tensorwise);
  auto float8_hooks = [](const torch::nn::Module& linear) {
    std::vector<std::string> names;
    for (const std::string& n : dtensor::module_hook_names(linear)) {
      if (n.rfind("Float8", 0) == 0) {
        names.push_back(n);
      }
    }
    return names;
  };
  CHECK(float8_hooks(*m->proj) == std::vector<std::string>{"Float8Linear(tensorwise)"});
  CHECK(float8_hooks(*m->output).empty()); // "output", and 10 features
  CHECK_THROWS_WITH(dtensor::convert_to_float8_training(*m, Float8LinearOptions()),
                    Catch::Contains("Linear 'proj' is converted already"));
  CHECK_THROWS_WITH(dtensor::float8_linear(at::randn({4, 16}), at::randn({64, 32}), {}, {}),
                    Catch::Contains("input [4, 16] does not fit weight [64, 32]"));
  const DeviceMesh mesh = init_device_mesh(device_type(), {1}, {"tp"});
  const at::Tensor x = dtensor::distribute_tensor(at::randn({4, 32}), mesh, {Placement::shard(0)});
  CHECK_THROWS_WITH(dtensor::float8_linear(x, at::randn({64, 32}), {}, {}),
                    Catch::Contains("the input is a DTensor (Shard(0)") &&
                        Catch::Contains("the weight is not"));
  const at::Tensor w =
      dtensor::DTensor::from_local(at::randn({64, 32}), mesh, {Placement::partial()}, {{64, 32}});
  CHECK_THROWS_WITH(dtensor::float8_linear(x, w, {}, {}),
                    Catch::Contains("the weight is (Partial(sum)) on mesh dimension 0"));
}

// Guards against a silent no-op: a torch::nn::Sequential calls its Linears' forward itself, so
// float8 hooks on them would never run (the model would train in high precision while the
// conversion reported success). The conversion refuses them, converting nothing; a Linear
// passed as the root is named as such when converted twice.
TEST_CASE("float8: Linears a Sequential calls are refused at conversion, nothing converted",
          "[world1]") {
  torch::nn::Sequential seq(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, 32));
  CHECK_THROWS_WITH(dtensor::convert_to_float8_training(*seq, Float8LinearOptions()),
                    Catch::Contains("Linears [0, 2] are called by a torch::nn::Sequential") &&
                        Catch::Contains("bypassing dtensor::call"));
  for (const auto& m : seq->modules()) {
    for (const std::string& hook : dtensor::module_hook_names(*m)) {
      CHECK(hook.rfind("Float8", 0) != 0);
    }
  }
  // A Sequential of modules that call their Linears through the seam is fine.
  torch::nn::Sequential blocks{TwoLinears(), TwoLinears()};
  CHECK(dtensor::convert_to_float8_training(*blocks, Float8LinearOptions()) ==
        std::vector<std::string>{"0.proj", "0.output", "1.proj", "1.output"});
  torch::nn::Linear lone(32, 64);
  CHECK(dtensor::convert_to_float8_training(*lone, Float8LinearOptions()) ==
        std::vector<std::string>{""});
  CHECK_THROWS_WITH(dtensor::convert_to_float8_training(*lone, Float8LinearOptions()),
                    Catch::Contains("Linear (the module passed) is converted already"));
}

// Guards float8 under fully_shard: the hook computes on the unit's unsharded weight (inside a
// local region), and its gradient reaches the reduce-scatter. Judge: the same module converted
// on one process, on each rank's rows.
TEST_CASE("float8: a converted module under fully_shard equals it on one process, every recipe",
          "[world2]") {
  for (Float8Recipe recipe :
       {Float8Recipe::Tensorwise, Float8Recipe::Rowwise, Float8Recipe::RowwiseWithGwHp}) {
    INFO(dtensor::name_of(recipe));
    TwoLinears plain = seeded(recipe);
    TwoLinears model = seeded(recipe);
    dtensor::fully_shard(*model, FullyShardOptions());
    at::manual_seed(9);
    const at::Tensor x = at::randn({2 * world(), 32});
    const at::Tensor g = at::randn({2 * world(), 10});
    CommDebugMode mode;
    const at::Tensor y = dtensor::call(model, x.narrow(0, 2 * rank(), 2));
    (y * g.narrow(0, 2 * rank(), 2)).sum().backward();
    CHECK(mode.count(CollectiveKind::AllGather) == 1);
    CHECK(mode.count(CollectiveKind::ReduceScatter) == 1);
    CHECK(mode.total_count() == 2);
    for (int64_t r = 0; r < world(); ++r) {
      const at::Tensor want = dtensor::call(plain, x.narrow(0, 2 * r, 2));
      if (r == rank()) {
        CHECK(same(y.detach(), want.detach()));
      }
      ((want * g.narrow(0, 2 * r, 2)).sum() / static_cast<double>(world())).backward();
    }
    CHECK(close(full_value(model->proj->weight.grad()), plain->proj->weight.grad()));
    CHECK(close(full_value(model->output->weight.grad()), plain->output->weight.grad()));
  }
}

namespace {

// proj 32 -> 64 (even shards) in a unit of its own, head 64 -> 3 (uneven; empty on 4 ranks) in
// the root's; every Linear converted, the float8 all-gather on or off; bf16 parameters in
// the all-gather with `bf16`.
TwoLinears float8_units(bool all_gather, bool bf16) {
  at::manual_seed(5);
  TwoLinears m(32, 64, 3);
  dtensor::convert_to_float8_training(
      *m, Float8LinearOptions().enable_fsdp_float8_all_gather(all_gather));
  FullyShardOptions options;
  if (bf16) {
    options.mp_policy(dtensor::MixedPrecisionPolicy().param_dtype(at::kBFloat16));
  }
  dtensor::fully_shard(*m->proj, options);
  dtensor::fully_shard(*m, options);
  return m;
}

// One forward and backward, with what CommDebugMode saw.
struct Step {
  at::Tensor y;
  int64_t all_gathers = 0;
  int64_t all_gather_bytes = 0;
  int64_t all_reduces = 0;
  int64_t unsharded_after_forward = 0; // fully_shard's unsharded bytes (the root's)
};

Step step(TwoLinears& m, const at::Tensor& x, const at::Tensor& g) {
  Step out;
  CommDebugMode mode;
  out.y = dtensor::call(m, x);
  out.unsharded_after_forward = dtensor::fsdp_memory_stats().unsharded_bytes;
  (out.y * g).sum().backward();
  out.all_gathers = mode.count(CollectiveKind::AllGather);
  out.all_gather_bytes = mode.bytes_in(CollectiveKind::AllGather);
  out.all_reduces = mode.count(CollectiveKind::AllReduce);
  return out;
}

} // namespace

// Guards [Note: float8 all-gather] (lib/parallel/fsdp/float8_all_gather.cpp): the bytes on the
// wire, the scales (one MAX all-reduce), uneven and empty shards (torchao#3982 crashes on
// them), and that the products see exactly the bits of the float8 model without it.
TEST_CASE("float8 all-gather: values equal float8 without it; bytes half of bf16's; one amax "
          "all-reduce per step with precompute",
          "[world2][world4]") {
  TwoLinears plain = float8_units(false, false);
  TwoLinears gathered = float8_units(true, false);
  TwoLinears bf16 = float8_units(false, true);
  torch::optim::SGD opt_plain(plain->parameters(), 0.5);
  torch::optim::SGD opt_gathered(gathered->parameters(), 0.5);
  at::manual_seed(11 + rank());
  for (int s = 0; s < 2; ++s) {
    INFO("step " << s);
    const at::Tensor x = at::randn({4, 32});
    const at::Tensor g = at::randn({4, 3});
    const Step a = step(plain, x, g);
    const Step b = step(gathered, x, g);
    const Step c = step(bf16, x, g);
    CHECK(same(b.y.detach(), a.y.detach()));
    for (const auto& [name, grad] : std::vector<std::pair<std::string, at::Tensor>>{
             {"proj", gathered->proj->weight.grad()},
             {"output", gathered->output->weight.grad()}}) {
      INFO(name);
      const at::Tensor want =
          name == "proj" ? plain->proj->weight.grad() : plain->output->weight.grad();
      CHECK(same(full_value(grad), full_value(want)));
    }
    // Every gathered byte is float8 where the bf16 run sends two (the segments are multiples
    // of 16 elements: no alignment padding).
    CHECK(b.all_gathers == c.all_gathers);
    CHECK(2 * b.all_gather_bytes == c.all_gather_bytes);
    // After forward the root unit holds the head's weight (3 x 64) unsharded: kept as the
    // gathered float8 bits, a byte an element, where bf16 takes two and fp32 four.
    CHECK(b.unsharded_after_forward == 3 * 64);
    CHECK(c.unsharded_after_forward == 3 * 64 * 2);
    CHECK(a.unsharded_after_forward == 3 * 64 * 4);
    // The scales: step 0 all-reduces each unit's amaxes as it first unshards; step 1 uses the
    // precomputed ones.
    CHECK(b.all_reduces == (s == 0 ? 2 : 0));
    CHECK(a.all_reduces == 0);
    opt_plain.step();
    opt_gathered.step();
    opt_plain.zero_grad();
    opt_gathered.zero_grad();
    bf16->zero_grad();
    CommDebugMode precompute;
    dtensor::precompute_float8_dynamic_scale_for_fsdp(*gathered);
    CHECK(precompute.count(CollectiveKind::AllReduce) == 1);
    CHECK(precompute.total_count() == 1);
  }
}

namespace {

// A SwiGLU feed-forward block: w1, w3 32 -> 64 (w1 with a bias), w2 64 -> 32 with a bias.
struct FfnImpl : torch::nn::Module {
  FfnImpl()
      : w1(register_module("w1", torch::nn::Linear(torch::nn::LinearOptions(32, 64)))),
        w2(register_module("w2", torch::nn::Linear(torch::nn::LinearOptions(64, 32)))),
        w3(register_module("w3", torch::nn::Linear(torch::nn::LinearOptions(32, 64).bias(false)))) {
  }
  at::Tensor forward(const at::Tensor& x) {
    return dtensor::call(w2, at::silu(dtensor::call(w1, x)) * dtensor::call(w3, x));
  }
  torch::nn::Linear w1, w2, w3;
};
TORCH_MODULE(Ffn);

Ffn ffn(std::optional<Float8Recipe> recipe, const std::optional<DeviceMesh>& tp) {
  at::manual_seed(21);
  Ffn m;
  if (recipe) {
    dtensor::convert_to_float8_training(*m, Float8LinearOptions().recipe(*recipe));
  }
  if (tp) {
    dtensor::parallelize_module(*m, *tp,
                                dtensor::ParallelizePlan{{"w1", dtensor::ColwiseParallel()},
                                                         {"w3", dtensor::ColwiseParallel()},
                                                         {"w2", dtensor::RowwiseParallel()}});
  }
  return m;
}

struct Counts {
  at::Tensor y;
  int64_t all_reduces = 0;
  int64_t total = 0;
};

Counts run(Ffn& m, const at::Tensor& x, const at::Tensor& g) {
  Counts out;
  CommDebugMode mode;
  out.y = dtensor::call(m, x);
  (out.y * g).sum().backward();
  out.all_reduces = mode.count(CollectiveKind::AllReduce);
  out.total = mode.total_count();
  return out;
}

// The amax all-reduces one FFN step adds under tp ([Note: float8 under tensor parallelism]):
// forward, w1 and w3 (Shard(0)) each one for a tensorwise weight, w2 (Shard(1), its input
// Shard(-1)) one for both; backward, w1 and w3 each one (the Shard(-1) output gradient, with the
// weight's columns for rowwise recipes or the tensorwise weight of rowwise_with_gw_hp), w2 one
// for tensorwise operands (x for grad_weight in tensorwise, the weight in rowwise_with_gw_hp).
int64_t amax_all_reduces(Float8Recipe recipe) {
  switch (recipe) {
  case Float8Recipe::Tensorwise:
    return 3 + 3;
  case Float8Recipe::Rowwise:
    return 1 + 2;
  case Float8Recipe::RowwiseWithGwHp:
    return 1 + 3;
  }
  return -1;
}

// The TP output against one process's. Tensorwise: the same float8 operands and fp32
// products, summed in another order (1e-4). Rowwise recipes: _scaled_mm gives each rank's
// partial product (RowwiseParallel's Partial output) in bf16, as torchao's does under TP, so the
// sum of the ranks' rounded pieces is within a few bf16 ulps of the rounded whole: 2^-7 of the
// largest magnitude.
bool float8_tp_close(Float8Recipe recipe, const at::Tensor& got, const at::Tensor& want) {
  if (recipe == Float8Recipe::Tensorwise) {
    return near(got, want);
  }
  const double bound = std::ldexp(want.abs().max().item<double>(), -7);
  return (got - want).abs().max().item<double>() <= bound;
}

} // namespace

// Guards [Note: float8 under tensor parallelism] (lib/parallel/float8/float8_tp.cpp): the
// scales are the whole tensors' (amaxes all-reduced where sharded), the placements and the
// gradients' are the matmul's (Partial out of sharded in features, a Partial input gradient
// out of a Shard(0) weight). Judge: the converted FFN on one process (itself bit-equal to
// torchao); the bf16 TP FFN for the collectives besides the amaxes.
TEST_CASE("float8 under tensor parallelism equals the converted model on one process, every "
          "recipe; the bf16 TP collectives plus the amax all-reduces",
          "[world2]") {
  const DeviceMesh tp = init_device_mesh(device_type(), {world()}, {"tp"});
  at::manual_seed(3);
  const at::Tensor x = at::randn({2, 8, 32});
  const at::Tensor g = at::randn({2, 8, 32});
  Ffn bf16 = ffn(std::nullopt, tp);
  const Counts base = run(bf16, x, g);
  for (Float8Recipe recipe :
       {Float8Recipe::Tensorwise, Float8Recipe::Rowwise, Float8Recipe::RowwiseWithGwHp}) {
    INFO(dtensor::name_of(recipe));
    Ffn plain = ffn(recipe, std::nullopt);
    Ffn model = ffn(recipe, tp);
    const Counts got = run(model, x, g);
    const Counts want = run(plain, x, g);
    CHECK(float8_tp_close(recipe, got.y.detach(), want.y.detach()));
    CHECK(!near(got.y.detach(), base.y.detach())); // float8 products, not bf16's
    for (const auto& [name, a, b] : std::vector<std::tuple<std::string, at::Tensor, at::Tensor>>{
             {"w1.weight", model->w1->weight.grad(), plain->w1->weight.grad()},
             {"w1.bias", model->w1->bias.grad(), plain->w1->bias.grad()},
             {"w3.weight", model->w3->weight.grad(), plain->w3->weight.grad()},
             {"w2.weight", model->w2->weight.grad(), plain->w2->weight.grad()},
             {"w2.bias", model->w2->bias.grad(), plain->w2->bias.grad()}}) {
      INFO(name);
      CHECK(near(full_value(a), b));
    }
    CHECK(got.all_reduces == base.all_reduces + amax_all_reduces(recipe));
    CHECK(got.total - got.all_reduces == base.total - base.all_reduces);
    // Under activation checkpointing (the block recomputed in backward, its amax all-reduces
    // with it): the same bits.
    Ffn ac = ffn(recipe, tp);
    dtensor::checkpoint_module(*ac);
    const Counts again = run(ac, x, g);
    CHECK(same(again.y.detach(), got.y.detach()));
    CHECK(same(full_value(ac->w1->weight.grad()), full_value(model->w1->weight.grad())));
    CHECK(same(full_value(ac->w2->weight.grad()), full_value(model->w2->weight.grad())));
  }
}

// Guards the layouts of [Note: float8 under tensor parallelism] beyond the TP styles: an input
// sharded along its rows beside a replicated weight stays sharded (its amax all-reduced: the
// same scale as the whole input's), beside a Shard(0) or Shard(1) weight it is redistributed
// first. Judge: float8_linear on the full tensors on one process, bit for bit (tensorwise;
// within 1e-4 where the in features are sharded).
TEST_CASE("float8_linear on DTensors: row-sharded input with a Replicate, Shard(0) and Shard(1) "
          "weight equals the full tensors' float8 product",
          "[world2]") {
  const DeviceMesh mesh = init_device_mesh(device_type(), {world()}, {"tp"});
  at::manual_seed(31);
  const at::Tensor x = at::randn({4 * world(), 32});
  const at::Tensor w = at::randn({16 * world(), 32}) * 0.1;
  const at::Tensor want = dtensor::float8_linear(x, w, {}, Float8LinearOptions());
  for (const Placement& wp : {Placement::replicate(), Placement::shard(0), Placement::shard(1)}) {
    INFO(wp.to_string());
    const at::Tensor xd = dtensor::distribute_tensor(x, mesh, {Placement::shard(0)});
    const at::Tensor wd = dtensor::distribute_tensor(w, mesh, {wp});
    const at::Tensor y = dtensor::float8_linear(xd, wd, {}, Float8LinearOptions());
    CHECK(DTensor(y).placements() ==
          Placements{wp.is_replicate()
                         ? Placement::shard(0)
                         : (wp.is_shard(0) ? Placement::shard(1) : Placement::partial())});
    // Sharded in features: the ranks' fp32 partial products summed in another order.
    CHECK((wp.is_shard(1) ? near(full_value(y), want) : same(full_value(y), want)));
  }
}

// Guards float8 with fully_shard over tensor parallelism: the weight is the unit's unsharded
// TP shard (a local region), its gradient reaches the reduce-scatter. Judge: the converted FFN
// on one process, on each dp rank's rows, gradients averaged.
TEST_CASE("float8 under fully_shard x tensor parallelism equals the converted model on one "
          "process",
          "[world4]") {
  const DeviceMesh mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
  const int64_t dp = mesh.get_local_rank("dp");
  at::manual_seed(3);
  const at::Tensor x = at::randn({4, 8, 32});
  const at::Tensor g = at::randn({4, 8, 32});
  for (Float8Recipe recipe : {Float8Recipe::Tensorwise, Float8Recipe::Rowwise}) {
    INFO(dtensor::name_of(recipe));
    Ffn plain = ffn(recipe, std::nullopt);
    Ffn model = ffn(recipe, mesh["tp"]);
    dtensor::fully_shard(*model, FullyShardOptions().mesh(mesh["dp"]));
    const at::Tensor y = dtensor::call(model, x.narrow(0, 2 * dp, 2));
    (y * g.narrow(0, 2 * dp, 2)).sum().backward();
    for (int64_t r = 0; r < 2; ++r) {
      const at::Tensor want = dtensor::call(plain, x.narrow(0, 2 * r, 2));
      if (r == dp) {
        CHECK(float8_tp_close(recipe, y.detach(), want.detach()));
      }
      ((want * g.narrow(0, 2 * r, 2)).sum() / 2.0).backward();
    }
    CHECK(near(full_value(model->w1->weight.grad()), plain->w1->weight.grad()));
    CHECK(near(full_value(model->w2->weight.grad()), plain->w2->weight.grad()));
    CHECK(near(full_value(model->w2->bias.grad()), plain->w2->bias.grad()));
  }
}

namespace {

// The largest difference relative to the reference's largest magnitude.
double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

dtensor::models::MoE float8_moe(bool ep) {
  using dtensor::models::MoEArgs;
  at::manual_seed(17);
  dtensor::models::MoE m(MoEArgs().dim(32).hidden_dim(32).num_experts(4).top_k(2));
  m->init_weights(0.02);
  CHECK(dtensor::models::convert_grouped_experts_to_float8(*m) ==
        std::vector<std::string>{"experts"});
  if (ep) {
    dtensor::ExpertParallel().apply(*m->experts,
                                    init_device_mesh(device_type(), {world()}, {"ep"}));
  }
  return m;
}

} // namespace

// Guards models/moe/float8.h on the module seam: the float8 hook runs inside ExpertParallel's
// dispatch, on the local experts, and adds no collective. Judge: the converted layer on one
// process (whose float8_grouped_mm torchao judges in float8_torchao).
TEST_CASE("float8 grouped experts under expert parallelism equal them on one process; the "
          "all-to-alls of the bf16 layer",
          "[world2]") {
  auto plain = float8_moe(false);
  auto ep = float8_moe(true);
  at::manual_seed(23);
  const at::Tensor x = at::randn({12 * world(), 32});
  const at::Tensor g = at::randn({12 * world(), 32});
  const at::Tensor xl = x.narrow(0, 12 * rank(), 12).clone().requires_grad_();
  const at::Tensor xp = x.clone().requires_grad_();
  CommDebugMode mode;
  const at::Tensor y = dtensor::call(ep, xl);
  CHECK(mode.count(CollectiveKind::AllToAll) == 3);
  (y * g.narrow(0, 12 * rank(), 12)).sum().backward();
  CHECK(mode.count(CollectiveKind::AllToAll) == 5);
  CHECK(mode.total_count() == 5);
  const at::Tensor want = dtensor::call(plain, xp);
  (want * g).sum().backward();
  CHECK(rel_diff(y.detach(), want.detach().narrow(0, 12 * rank(), 12)) < 1e-4);
  CHECK(rel_diff(xl.grad(), xp.grad().narrow(0, 12 * rank(), 12)) < 1e-4);
  CHECK(rel_diff(want.detach(), [&] {
          dtensor::models::MoE bf16(
              dtensor::models::MoEArgs().dim(32).hidden_dim(32).num_experts(4).top_k(2));
          at::manual_seed(17);
          bf16->init_weights(0.02);
          return dtensor::call(bf16, x).detach();
        }()) > 1e-3); // float8 products, not high precision's
  const int64_t local = 4 / world();
  for (const auto& [name, w, ref] : std::vector<std::tuple<std::string, at::Tensor, at::Tensor>>{
           {"w1", ep->experts->w1, plain->experts->w1},
           {"w2", ep->experts->w2, plain->experts->w2},
           {"w3", ep->experts->w3, plain->experts->w3}}) {
    INFO(name);
    CHECK(rel_diff(DTensor(w.grad()).to_local(), ref.grad().narrow(0, rank() * local, local)) <
          1e-4);
  }
}
