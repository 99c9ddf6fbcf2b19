// Redistribution: a property test over random (shape, mesh, source, target) cases, each
// checked for values (full_tensor equals the original) and for its exact collective count
// (CommDebugMode equals the planner's communicating steps); gradients through redistribute.
#include <random>

#include "support/prelude.h"
#include "tensor/redistribute/redistribute.h"

namespace {

std::vector<dtensor::DeviceMesh> meshes() { return dtensor::testing::property_meshes(); }

Placement random_placement(std::mt19937& rng, int64_t ndim, bool allow_partial) {
  int kinds = allow_partial ? 5 : 3;
  int k = std::uniform_int_distribution<int>(0, kinds - 1)(rng);
  if (k == 0 && ndim > 0) {
    return Placement::replicate();
  }
  if (k <= 2 && ndim > 0) {
    // Negative dims half the time: they must be normalised.
    int64_t d = std::uniform_int_distribution<int64_t>(0, ndim - 1)(rng);
    return Placement::shard(k == 2 ? d - ndim : d);
  }
  if (k == 3) {
    return Placement::partial(dtensor::ReduceOp::Sum);
  }
  if (k == 4) {
    return Placement::partial(dtensor::ReduceOp::Max);
  }
  return Placement::replicate();
}

// The source DTensor built without communication: this rank's piece of `full`; for
// Partial(sum) mesh dims only coordinate 0 holds the value (others zero), for Partial(max)
// every rank holds it.
DTensor make_source(const at::Tensor& full, const dtensor::DeviceMesh& mesh, const Placements& src) {
  at::Tensor local = dtensor::testing::local_piece(full, mesh, src);
  auto coord = *mesh.get_coordinate();
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i].is_partial() && src[i].reduce_op() == dtensor::ReduceOp::Sum && coord[i] != 0) {
      local = at::zeros_like(local);
    }
  }
  return DTensor::from_local(local, mesh, src, full.sizes().vec());
}

} // namespace

TEST_CASE("redistribute: random cases keep values and use one collective per planned step",
          "[dtensor][redistribute][world1][world2][world4]") {
  std::mt19937 rng(20261121); // same cases on every rank
  int cases = 0;
  int collectives = 0;
  for (const auto& mesh : meshes()) {
    for (int c = 0; c < 120; ++c) {
      int64_t ndim = std::uniform_int_distribution<int64_t>(1, 3)(rng);
      std::vector<int64_t> shape;
      for (int64_t d = 0; d < ndim; ++d) {
        // Mostly 1..7 (uneven over 2 and 4 ranks), sometimes 0 (empty shards everywhere).
        int64_t s = std::uniform_int_distribution<int64_t>(0, 9)(rng);
        shape.push_back(s == 0 ? 0 : 1 + s % 7);
      }
      Placements src;
      Placements dst;
      for (int64_t i = 0; i < mesh.ndim(); ++i) {
        src.push_back(random_placement(rng, ndim, true));
        dst.push_back(random_placement(rng, ndim, true));
      }
      at::Tensor full = (at::arange(c10::multiply_integers(shape), options(at::kDouble)) + 1).view(shape);
      INFO(mesh.to_string() << " shape " << full.sizes() << " " << dtensor::to_string(src) << " -> "
                            << dtensor::to_string(dst));
      DTensor source = make_source(full, mesh, src);
      auto plan = dtensor::detail::plan_redistribute(source.spec(), dst);
      int64_t planned = 0;
      for (const auto& step : plan) {
        planned += step.communicates ? 1 : 0;
      }
      CommDebugMode mode;
      DTensor moved = source.redistribute(dst);
      REQUIRE(mode.total_count() == planned);
      collectives += static_cast<int>(planned);
      REQUIRE(moved.to_local().sizes().vec() == moved.spec().local_shape());
      for (size_t i = 0; i < dst.size(); ++i) {
        REQUIRE(moved.placements()[i] == dst[i].normalized(ndim));
      }
      REQUIRE(same(moved.full_tensor(), full));
      ++cases;
    }
  }
  if (rank() == 0) {
    std::printf("redistribute property test: %d cases, %d collectives, world %d\n", cases,
                collectives, world());
  }
  REQUIRE(cases == 120 * static_cast<int>(meshes().size()));
}

TEST_CASE("redistribute: each transition uses its collective", "[dtensor][redistribute][world4]") {
  auto mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
  at::Tensor full = at::arange(64, options(at::kDouble)).view({8, 8});
  auto S = [](int64_t d) { return Placement::shard(d); };
  auto R = Placement::replicate();
  auto P = Placement::partial();
  struct Case {
    Placements src, dst;
    dtensor::CollectiveKind kind;
    const char* group;
  };
  std::vector<Case> table = {
      {{S(0), R}, {R, R}, dtensor::CollectiveKind::AllGather, "dp"},
      {{R, P}, {R, R}, dtensor::CollectiveKind::AllReduce, "tp"},
      {{P, R}, {S(1), R}, dtensor::CollectiveKind::ReduceScatter, "dp"},
      {{R, S(0)}, {R, S(1)}, dtensor::CollectiveKind::AllToAll, "tp"},
  };
  for (const auto& c : table) {
    DTensor source = make_source(full, mesh, c.src);
    CommDebugMode mode;
    DTensor moved = source.redistribute(c.dst);
    REQUIRE(mode.total_count() == 1);
    REQUIRE(mode.count(c.group, c.kind) == 1);
    REQUIRE(same(moved.full_tensor(), full));
  }
  // Local-only transitions: Replicate -> Shard and Replicate -> Partial.
  DTensor rep = make_source(full, mesh, {R, R});
  CommDebugMode mode;
  DTensor sharded = rep.redistribute({S(0), S(1)});
  DTensor partial = rep.redistribute({P, R});
  REQUIRE(mode.total_count() == 0);
  REQUIRE(sharded.to_local().sizes() == at::IntArrayRef({4, 4}));
  REQUIRE(same(partial.full_tensor(), full));
}

TEST_CASE("gradients flow back through redistribute", "[dtensor][autograd][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  at::Tensor full = at::arange(24, options(at::kDouble)).view({6, 4});
  at::Tensor weight = at::arange(24, options(at::kDouble)).view({6, 4}) * 0.5 - 3;
  std::vector<std::pair<Placements, Placements>> cases = {
      {{Placement::shard(0)}, {Placement::replicate()}},
      {{Placement::replicate()}, {Placement::shard(1)}},
      {{Placement::shard(1)}, {Placement::shard(0)}},
      {{Placement::shard(0)}, {Placement::partial()}},
  };
  for (const auto& [src, dst] : cases) {
    INFO(dtensor::to_string(src) << " -> " << dtensor::to_string(dst));
    DTensor x = dtensor::distribute_tensor(full, mesh, src);
    x.set_requires_grad(true);
    at::Tensor z = x.redistribute(dst).full_tensor();
    at::Tensor loss = (z * weight).sum();
    loss.backward();
    REQUIRE(dtensor::is_dtensor(x.grad()));
    DTensor g(x.grad());
    REQUIRE(g.placements() == x.placements());
    REQUIRE(same(g.full_tensor(), weight));
  }
}

TEST_CASE("distribute_tensor on a sub-mesh takes its first rank's values (src_data_rank 0)",
          "[dtensor][world1][world2][world4]") {
  // PyTorch's src_data_rank is a group rank on each mesh dimension: 0 is every sub-mesh's
  // own first rank (a global rank 0 would not be in most sub-meshes).
  const int64_t tp = world() >= 2 ? 2 : 1;
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{world() / tp, tp},
                                            std::vector<int64_t>{world(), 1}}) {
    auto mesh = init_device_mesh(device_type(), shape, {"dp", "tp"});
    const DeviceMesh sub = mesh["tp"];
    at::Tensor mine = at::full({4}, static_cast<double>(rank()), options(at::kDouble));
    CommDebugMode mode;
    DTensor d = dtensor::distribute_tensor(mine, sub, {Placement::replicate()});
    REQUIRE(mode.count(CollectiveKind::Broadcast) == 1);
    const double first = sub.ranks().front();
    REQUIRE(same(d.to_local(), at::full({4}, first, options(at::kDouble))));
    // nullopt: no communication, every rank keeps its own data.
    CommDebugMode none;
    DTensor own = dtensor::distribute_tensor(mine, sub, {Placement::replicate()}, std::nullopt);
    REQUIRE(none.total_count() == 0);
    REQUIRE(same(own.to_local(), mine));
    REQUIRE_THROWS_WITH(dtensor::distribute_tensor(mine, sub, {Placement::replicate()}, 2),
                        contains("src_data_rank 2 is not a group rank of mesh dimension 0"));
  }
}

TEST_CASE("distribute_tensor takes src_rank's values", "[dtensor][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  // Every rank starts from different data; rank world-1's must win.
  at::Tensor mine = at::full({5, 3}, static_cast<double>(rank()), options(at::kDouble));
  CommDebugMode mode;
  DTensor d = dtensor::distribute_tensor(mine, mesh, {Placement::shard(0)}, world() - 1);
  REQUIRE(mode.count(dtensor::CollectiveKind::Broadcast) == 1);
  REQUIRE(same(d.full_tensor(), at::full({5, 3}, static_cast<double>(world() - 1), options(at::kDouble))));
  REQUIRE(d.to_local().size(0) == dtensor::chunk_size(5, world(), rank()));
}

TEST_CASE("redistribute: Partial(sum) and Partial(max) on two mesh dims reduce in mesh-dim order",
          "[dtensor][redistribute][world4]") {
  // [Note: partial order]: the value of (Partial(sum), Partial(max)) on (dp, tp) is the max
  // over tp of the sums over dp. Keeping dp Partial while tp changes must not reduce tp
  // first (max and sum do not commute).
  auto mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
  const int64_t dp = mesh.get_local_rank(0);
  const int64_t tp = mesh.get_local_rank(1);
  auto local_of = [](int64_t d, int64_t t) { // sum-then-max [1, 2]; max-then-sum [2, 6]
    return at::tensor({d == t ? 1.0 : 0.0, d == t ? 3.0 : -1.0}, options());
  };
  at::Tensor expected = at::maximum(local_of(0, 0) + local_of(1, 0), local_of(0, 1) + local_of(1, 1));
  const Placements src{Placement::partial(), Placement::partial(ReduceOp::Max)};
  DTensor d = DTensor::from_local(local_of(dp, tp), mesh, src);
  REQUIRE(close(d.full_tensor(), expected, 0, 0));
  for (const Placements& dst :
       {Placements{Placement::partial(), Placement::replicate()},
        Placements{Placement::partial(), Placement::shard(0)},
        Placements{Placement::replicate(), Placement::replicate()},
        Placements{Placement::shard(0), Placement::replicate()}}) {
    INFO("to " << dtensor::to_string(dst));
    DTensor r = d.redistribute(mesh, dst);
    REQUIRE(r.placements() == dst);
    REQUIRE(close(r.full_tensor(), expected, 0, 0));
  }
}
