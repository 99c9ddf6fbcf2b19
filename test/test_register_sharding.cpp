// register_sharding (include/dtensor/register_sharding.h): a user function as the sharding
// rule of a custom op and in place of dtensor's own, with PyTorch's semantics (one of the
// acceptable shardings per mesh dim, the cheapest for the inputs as they are) and errors;
// values against the plain op, exact collective counts.
#include <torch/library.h>

#include <dtensor/register_sharding.h>

#include "support/prelude.h"

using dtensor::AcceptableSharding;
using dtensor::ShardingArgs;

namespace {

at::Tensor scale_rows(const at::Tensor& x, double s) {
  return x * s + 1.0;
}

at::Tensor twice(const at::Tensor& x) {
  return x * 2.0;
}

} // namespace

// A custom op with backend and meta kernels (the meta one gives the output's global shape),
// and one with a CompositeExplicitAutograd kernel only.
TORCH_LIBRARY(dtensor_test, m) {
  m.def("scale_rows(Tensor x, float s) -> Tensor");
  m.def("twice(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(dtensor_test, CPU, m) {
  m.impl("scale_rows", &scale_rows);
}
TORCH_LIBRARY_IMPL(dtensor_test, CUDA, m) {
  m.impl("scale_rows", &scale_rows);
}
TORCH_LIBRARY_IMPL(dtensor_test, Meta, m) {
  m.impl("scale_rows", &scale_rows);
}
TORCH_LIBRARY_IMPL(dtensor_test, CompositeExplicitAutograd, m) {
  m.impl("twice", &twice);
}
// No autograd formula: LibTorch 2.9.1 has no autograd fallback for PrivateUse1 (2.15 does), so
// the op says it has nothing to do there.
TORCH_LIBRARY_IMPL(dtensor_test, AutogradPrivateUse1, m) {
  m.impl("scale_rows", torch::CppFunction::makeFallthrough());
  m.impl("twice", torch::CppFunction::makeFallthrough());
}

namespace {

at::Tensor call_scale_rows(const at::Tensor& x, double s) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dtensor_test::scale_rows", "")
                       .typed<at::Tensor(const at::Tensor&, double)>();
  return op.call(x, s);
}

at::Tensor call_twice(const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dtensor_test::twice", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(x);
}

// Row-wise: Replicate, or Shard on any dim of x; the scalar has no placement.
std::vector<AcceptableSharding> rowwise(const ShardingArgs& args) {
  std::vector<AcceptableSharding> out{
      {{Placement::replicate()}, {Placement::replicate(), std::nullopt}}};
  for (int64_t d = 0; d < args.specs[0]->ndim(); ++d) {
    out.push_back({{Placement::shard(d)}, {Placement::shard(d), std::nullopt}});
  }
  return out;
}

at::Tensor input() {
  return at::arange(48, options()).view({8, 6}) / 7.0;
}

} // namespace

TEST_CASE("register_sharding: a custom op runs on the shardings its function accepts",
          "[register_sharding][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  const at::Tensor want = scale_rows(input(), 3.0);
  DTensor rows = dtensor::distribute_tensor(input(), mesh, {Placement::shard(0)});

  // No rule: the op is named with its placements.
  REQUIRE_THROWS_WITH(call_scale_rows(rows, 3.0), contains("dtensor_test::scale_rows"));
  REQUIRE_THROWS_WITH(call_scale_rows(rows, 3.0), contains("no sharding rule"));

  dtensor::register_sharding("dtensor_test::scale_rows", rowwise);
  {
    CommDebugMode mode;
    DTensor out(call_scale_rows(rows, 3.0));
    REQUIRE(mode.total_count() == 0); // Shard(0) is acceptable as it is
    REQUIRE(out.placements() == Placements{Placement::shard(0)});
    REQUIRE(out.sizes().vec() == std::vector<int64_t>{8, 6});
    REQUIRE(close(out.full_tensor(), want));
  }
  {
    // A Partial input is not acceptable: the cheapest acceptable sharding (Replicate, the
    // first of equal cost) costs one all-reduce.
    DTensor partial =
        DTensor::from_local(input() / static_cast<double>(world()), mesh, {Placement::partial()});
    CommDebugMode mode;
    DTensor out(call_scale_rows(partial, 3.0));
    const int64_t reduces = world() > 1 ? 1 : 0; // one rank: nothing to reduce
    REQUIRE(mode.count(CollectiveKind::AllReduce) == reduces);
    REQUIRE(mode.total_count() == reduces);
    REQUIRE(out.placements() == Placements{Placement::replicate()});
    REQUIRE(close(out.full_tensor(), want));
  }
  dtensor::unregister_sharding("dtensor_test::scale_rows");
  REQUIRE_THROWS_WITH(call_scale_rows(rows, 3.0), contains("no sharding rule"));
}

TEST_CASE("register_sharding replaces dtensor's rule until unregistered, also for composite ops",
          "[register_sharding][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  DTensor rows = dtensor::distribute_tensor(input(), mesh, {Placement::shard(0)});
  const at::Tensor want = at::_softmax(input(), 1, false);
  const int64_t gathers = world() > 1 ? 1 : 0;
  {
    CommDebugMode mode; // dtensor's rule: rows stay sharded
    DTensor out(at::_softmax(rows, 1, false));
    REQUIRE(mode.total_count() == 0);
    REQUIRE(out.placements() == Placements{Placement::shard(0)});
  }
  dtensor::register_sharding("aten::_softmax", [](const ShardingArgs&) {
    return std::vector<AcceptableSharding>{
        {{Placement::replicate()}, {Placement::replicate(), std::nullopt, std::nullopt}}};
  });
  {
    CommDebugMode mode; // only Replicate accepted: one all-gather
    DTensor out(at::_softmax(rows, 1, false));
    REQUIRE(mode.count(CollectiveKind::AllGather) == gathers);
    REQUIRE(mode.total_count() == gathers);
    REQUIRE(out.placements() == Placements{Placement::replicate()});
    REQUIRE(close(out.full_tensor(), want));
  }
  dtensor::unregister_sharding("aten::_softmax");
  {
    CommDebugMode mode;
    DTensor out(at::_softmax(rows, 1, false));
    REQUIRE(mode.total_count() == 0);
    REQUIRE(out.placements() == Placements{Placement::shard(0)});
    REQUIRE(close(out.full_tensor(), want));
  }
  // A custom op with a CompositeExplicitAutograd kernel: without a rule its kernel runs on
  // the DTensor (each op inside meets its rule); with one, the handler takes it.
  {
    CommDebugMode mode;
    DTensor out(call_twice(rows));
    REQUIRE(mode.total_count() == 0);
    REQUIRE(out.placements() == Placements{Placement::shard(0)});
    REQUIRE(close(out.full_tensor(), input() * 2.0));
  }
  dtensor::register_sharding("dtensor_test::twice", [](const ShardingArgs&) {
    return std::vector<AcceptableSharding>{{{Placement::replicate()}, {Placement::replicate()}}};
  });
  {
    CommDebugMode mode;
    DTensor out(call_twice(rows));
    REQUIRE(mode.total_count() == gathers);
    REQUIRE(out.placements() == Placements{Placement::replicate()});
    REQUIRE(close(out.full_tensor(), input() * 2.0));
  }
  dtensor::unregister_sharding("dtensor_test::twice");
}

TEST_CASE("register_sharding: bad functions and names are named",
          "[register_sharding][errors][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  DTensor rows = dtensor::distribute_tensor(input(), mesh, {Placement::shard(0)});
  REQUIRE_THROWS_WITH(dtensor::register_sharding("dtensor_test::no_such_op", rowwise),
                      contains("register_sharding: no operator named dtensor_test::no_such_op"));
  REQUIRE_THROWS_WITH(dtensor::unregister_sharding("dtensor_test::scale_rows"),
                      contains("no function is registered for dtensor_test::scale_rows"));
  // One input placement short (the scalar's nullopt is missing).
  dtensor::register_sharding("dtensor_test::scale_rows", [](const ShardingArgs&) {
    return std::vector<AcceptableSharding>{{{Placement::replicate()}, {Placement::replicate()}}};
  });
  REQUIRE_THROWS_WITH(call_scale_rows(rows, 3.0),
                      contains("register_sharding for dtensor_test::scale_rows: acceptable "
                               "sharding 0 gives 1 output and 1 input placements; the op "
                               "returns 1 and takes 2 arguments"));
  // Nothing fits: Shard(2) of a 2-D input.
  dtensor::register_sharding("dtensor_test::scale_rows", [](const ShardingArgs&) {
    return std::vector<AcceptableSharding>{
        {{Placement::shard(2)}, {Placement::shard(2), std::nullopt}}};
  });
  REQUIRE_THROWS_WITH(call_scale_rows(rows, 3.0),
                      contains("none of the 1 shardings its register_sharding function accepts "
                               "fits these inputs"));
  dtensor::unregister_sharding("dtensor_test::scale_rows");
}
