// User code next to DTensors: local_map and ImplicitReplication, with PyTorch's
// semantics and errors, judged against the plain computation (values and gradients) with
// exact collective counts.
#include "support/prelude.h"

using dtensor::ImplicitReplication;
using dtensor::LocalMapOptions;

namespace {

at::Tensor value(int64_t seed, std::vector<int64_t> shape) {
  at::manual_seed(seed);
  return at::randn(shape, options());
}

// A row-wise scale-and-shift as a user kernel: rows are independent, so it runs on any
// row shard as it is.
std::vector<at::Tensor> kernel(const std::vector<at::Tensor>& in) {
  return {in[0] * in[1] + in[1].pow(2)};
}

} // namespace

TEST_CASE("local_map runs a plain function on the local shards, gradients included",
          "[user_rules][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  const Placements rows{Placement::shard(0)};
  const Placements whole{Placement::replicate()};
  at::Tensor x_plain = value(1, {8, 6}).requires_grad_(true);
  at::Tensor w_plain = value(2, {6}).requires_grad_(true);
  at::Tensor want = kernel({x_plain, w_plain})[0];
  want.sum().backward();

  at::Tensor x = dtensor::distribute_tensor(value(1, {8, 6}), mesh, rows);
  at::Tensor w = dtensor::distribute_tensor(value(2, {6}), mesh, whole);
  x.requires_grad_(true);
  w.requires_grad_(true);
  auto mapped = dtensor::local_map(
      kernel, LocalMapOptions().out_placements({rows}).in_placements({rows, whole}));
  CommDebugMode mode;
  at::Tensor out = mapped({x, w})[0];
  REQUIRE(mode.total_count() == 0); // the layouts matched: nothing moved
  REQUIRE(DTensor(out).placements() == rows);
  REQUIRE(close(full_value(out), want));
  out.sum().backward();
  REQUIRE(close(full_value(x.grad()), x_plain.grad()));
  // w's gradient: each rank's local sum over its rows, as a Replicate local_map input gives
  // it back (PyTorch's to_local backward): the sum over ranks is the plain gradient.
  at::Tensor summed =
      dtensor::all_reduce(DTensor(w.grad()).to_local(), ReduceOp::Sum, mesh.get_group());
  REQUIRE(close(summed, w_plain.grad()));
}

TEST_CASE("local_map checks in_placements and redistributes only when asked",
          "[user_rules][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  const Placements rows{Placement::shard(0)};
  const Placements whole{Placement::replicate()};
  at::Tensor x = dtensor::distribute_tensor(value(1, {8, 6}), mesh, rows);
  at::Tensor w = dtensor::distribute_tensor(value(2, {6}), mesh, rows); // not what it wants
  auto strict = dtensor::local_map(
      kernel, LocalMapOptions().out_placements({rows}).in_placements({rows, whole}));
  REQUIRE_THROWS_WITH(strict({x, w}), contains("local_map: input 1") &&
                                          contains("placements (Shard(0))") &&
                                          contains("in_placements[1] is (Replicate())"));
  auto lenient = dtensor::local_map(kernel, LocalMapOptions()
                                                .out_placements({rows})
                                                .in_placements({rows, whole})
                                                .redistribute_inputs(true));
  CommDebugMode mode;
  at::Tensor out = lenient({x, w})[0];
  REQUIRE(mode.count(CollectiveKind::AllGather) == 1); // w: Shard(0) -> Replicate
  REQUIRE(mode.total_count() == 1);
  REQUIRE(close(full_value(out), kernel({value(1, {8, 6}), value(2, {6})})[0]));
}

TEST_CASE("local_map: plain inputs call the function as it is; bad counts are named",
          "[user_rules][world1][world2]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  const Placements rows{Placement::shard(0)};
  auto mapped = dtensor::local_map(kernel, LocalMapOptions().out_placements({rows}));
  at::Tensor plain = mapped({value(1, {8, 6}), value(2, {6})})[0];
  REQUIRE_FALSE(dtensor::is_dtensor(plain));
  REQUIRE(same(plain, kernel({value(1, {8, 6}), value(2, {6})})[0]));
  at::Tensor x = dtensor::distribute_tensor(value(1, {8, 6}), mesh, rows);
  auto two_out = dtensor::local_map(kernel, LocalMapOptions().out_placements({rows, rows}));
  REQUIRE_THROWS_WITH(two_out({x, value(2, {6})}),
                      contains("returned 1 tensors, out_placements has 2"));
  auto three_in = dtensor::local_map(
      kernel, LocalMapOptions().out_placements({rows}).in_placements({rows, rows, rows}));
  REQUIRE_THROWS_WITH(three_in({x, value(2, {6})}), contains("3 in_placements for 2 inputs"));
}

TEST_CASE("ImplicitReplication: plain tensors mix with DTensors as Replicate",
          "[user_rules][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  at::Tensor x = dtensor::distribute_tensor(value(1, {8, 6}), mesh, {Placement::shard(0)});
  at::Tensor bias = value(2, {8, 6});
  REQUIRE_THROWS_WITH(x + bias, contains("mixes DTensors with plain tensors"));
  at::Tensor out;
  {
    ImplicitReplication scope;
    CommDebugMode mode;
    out = x + bias;
    REQUIRE(mode.total_count() == 0); // a Replicate operand is sliced locally
    REQUIRE(DTensor(out).placements() == Placements{Placement::shard(0)});
    REQUIRE_THROWS_WITH(bias.add_(x),
                        contains("aten::add_") && contains("plain tensor the op writes into"));
  }
  REQUIRE(close(full_value(out), value(1, {8, 6}) + bias));
  REQUIRE_FALSE(dtensor::implicit_replication_enabled());
  REQUIRE_THROWS_WITH(x + bias, contains("mixes DTensors with plain tensors"));
}
