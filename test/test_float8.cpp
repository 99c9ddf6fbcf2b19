// Float8 linears (include/dtensor/float8.h, docs/float8.md). Their numerics are judged by
// torchao itself in test/float8/torchao_judge.py (bit-equal for every recipe); here:
//  - world1: refusals, each naming what was wrong: an unknown recipe, a Linear converted twice,
//    a DTensor input (tensor parallelism), an input that does not fit the weight; the filter
//    (torchtitan's: not the output, features multiples of 16).
//  - world2: a converted module under fully_shard equals, on each rank's rows, the same module
//    converted on one process (its float8 products with the rank's own input scales), the
//    gradients averaged over the ranks; every recipe; 1 all-gather per unit and call, 1
//    reduce-scatter per unit in backward (the float8 products add no collective).
#include <dtensor/float8.h>

#include <torch/nn/modules/linear.h>

#include "support/prelude.h"

using dtensor::Float8LinearOptions;
using dtensor::Float8Recipe;

namespace {

struct TwoLinearsImpl : torch::nn::Module {
  TwoLinearsImpl()
      : proj(register_module("proj",
                             torch::nn::Linear(torch::nn::LinearOptions(32, 64).bias(false)))),
        output(register_module("output",
                               torch::nn::Linear(torch::nn::LinearOptions(64, 10).bias(false)))) {}
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
                    Catch::Contains("the input is a DTensor ((Shard(0)))") &&
                        Catch::Contains("tensor parallelism"));
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
