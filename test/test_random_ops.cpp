// Randomized differential test, judged against the plain op on the full tensor: random
// shapes (uneven and empty shards), meshes (1-D, 2-D, and on 4 ranks 3-D), source
// placements (Shard, Replicate, Partial sum / avg / max / min) and targets. Each case
// redistributes (values and the exact collective count checked), then runs a dozen ops on
// the source and on the result, each compared with the same op on the full tensor; an op
// that the plain tensor refuses must raise a dtensor::Error on every rank. Fixed seeds: the
// same cases on every rank and in every run.
#include <cmath>
#include <functional>
#include <random>

#include "support/prelude.h"
#include "tensor/redistribute/redistribute.h"

namespace {

std::vector<dtensor::DeviceMesh> meshes() { return dtensor::testing::property_meshes(); }

const ReduceOp kPartialOps[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min};

Placement random_placement(std::mt19937& rng, int64_t ndim) {
  int k = std::uniform_int_distribution<int>(0, 5)(rng);
  if (k <= 1) {
    return Placement::replicate();
  }
  if (k <= 3) {
    int64_t d = std::uniform_int_distribution<int64_t>(0, ndim - 1)(rng);
    return Placement::shard(k == 3 ? d - ndim : d); // negative dims half the time
  }
  return Placement::partial(kPartialOps[std::uniform_int_distribution<int>(0, 3)(rng)]);
}

// This rank's local tensor of `full` laid out as `src`, built without dtensor's
// redistribution: Shard placements slice; on the first Partial mesh dim the ranks hold
// different values whose reduction is `full` (sum: weights (c+1)/T; avg: +-offsets summing
// to zero; max / min: `full` on coordinate 0, smaller / larger values elsewhere); on later
// Partial dims the ranks hold the neutral split (sum: coordinate 0 only; others: all the
// same), so the order of reduction does not matter.
at::Tensor make_local(const at::Tensor& full, const dtensor::DeviceMesh& mesh, const Placements& src) {
  at::Tensor local = dtensor::testing::local_piece(full, mesh, src);
  auto coord = *mesh.get_coordinate();
  bool first = true;
  for (size_t i = 0; i < src.size(); ++i) {
    if (!src[i].is_partial()) {
      continue;
    }
    auto c = static_cast<double>(coord[i]);
    auto k = static_cast<double>(mesh.size(static_cast<int64_t>(i)));
    switch (src[i].reduce_op()) {
    case ReduceOp::Sum:
      local = first ? local * ((c + 1) / (k * (k + 1) / 2)) : (coord[i] == 0 ? local : local * 0);
      break;
    case ReduceOp::Avg:
      local = first ? local + (c - (k - 1) / 2) * 0.25 : local;
      break;
    case ReduceOp::Max:
      local = first && coord[i] != 0 ? local - 0.5 * c : local;
      break;
    case ReduceOp::Min:
      local = first && coord[i] != 0 ? local + 0.5 * c : local;
      break;
    default:
      break;
    }
    first = false;
  }
  return local;
}

bool matches(const at::Tensor& got, const at::Tensor& want) {
  return got.sizes() == want.sizes() && got.scalar_type() == want.scalar_type() &&
         at::allclose(got.cpu(), want.cpu(), 1e-9, 1e-9, /*equal_nan=*/true);
}

struct NamedOp {
  const char* name;
  std::function<at::Tensor(const at::Tensor&)> fn;
};

std::vector<NamedOp> ops() {
  return {
      {"neg", [](const at::Tensor& t) { return t.neg(); }},
      {"exp", [](const at::Tensor& t) { return t.exp(); }},
      {"mul 2.5", [](const at::Tensor& t) { return t * 2.5; }},
      {"add 1", [](const at::Tensor& t) { return t + 1; }},
      {"abs", [](const at::Tensor& t) { return t.abs(); }},
      {"relu", [](const at::Tensor& t) { return t.relu(); }},
      {"sigmoid", [](const at::Tensor& t) { return t.sigmoid(); }},
      {"t + t", [](const at::Tensor& t) { return t + t; }},
      {"t * t", [](const at::Tensor& t) { return t * t; }},
      {"sum", [](const at::Tensor& t) { return t.sum(); }},
      {"sum(0)", [](const at::Tensor& t) { return t.sum(0); }},
      {"mean(-1)", [](const at::Tensor& t) { return t.mean(-1); }},
      {"amax(-1)", [](const at::Tensor& t) { return t.amax(-1); }},
      {"transpose.contiguous.view", [](const at::Tensor& t) { return t.transpose(0, -1).contiguous().view(-1); }},
      {"reshape(-1)", [](const at::Tensor& t) { return t.reshape({-1}); }},
  };
}

// `op` on the DTensor against `op` on `full`: the same values, or the same refusal.
void check_op(const NamedOp& op, const DTensor& d, const at::Tensor& full) {
  INFO("op " << op.name << " on " << dtensor::to_string(d.placements()));
  at::Tensor want;
  bool plain_refuses = false;
  try {
    want = op.fn(full);
  } catch (const c10::Error&) {
    plain_refuses = true;
  }
  if (plain_refuses) {
    REQUIRE_THROWS_AS(DTensor(op.fn(d)).full_tensor(), dtensor::Error);
    return;
  }
  at::Tensor got = DTensor(op.fn(d)).full_tensor();
  REQUIRE(matches(got, want));
}

// Collectives of a 1-D redistribution, counted independently of the planner: none for an
// unchanged placement or from Replicate; one otherwise.
int64_t expected_1d(const Placement& src, const Placement& dst) {
  // Shard -> Partial(sum) zero-fills in place (PyTorch 2.15 does the same, and counts none).
  bool zero_fill = src.is_shard() && dst.is_partial() && !dst.is_norm_partial() &&
                   dst.reduce_op() == ReduceOp::Sum;
  return (src == dst || src.is_replicate() || zero_fill) ? 0 : 1;
}

} // namespace

TEST_CASE("random redistributions and ops match the plain op on the full tensor",
          "[dtensor][random][world1][world2][world4]") {
  std::mt19937 rng(20261123 + static_cast<unsigned>(world())); // same cases on every rank
  const auto all_ops = ops();
  const auto mesh_list = meshes();
  const int per_mesh = 1000 / static_cast<int>(mesh_list.size()) + 1;
  int cases = 0;
  int64_t collectives = 0;
  int64_t op_checks = 0;
  for (const auto& mesh : mesh_list) {
    for (int c = 0; c < per_mesh; ++c) {
      int64_t ndim = std::uniform_int_distribution<int64_t>(1, 3)(rng);
      std::vector<int64_t> shape;
      for (int64_t d = 0; d < ndim; ++d) {
        int64_t s = std::uniform_int_distribution<int64_t>(0, 12)(rng);
        shape.push_back(s == 0 ? 0 : 1 + s % 7); // 1..7: uneven over 2 and 4; 0: empty
      }
      Placements src;
      Placements dst;
      for (int64_t i = 0; i < mesh.ndim(); ++i) {
        src.push_back(random_placement(rng, ndim));
        dst.push_back(random_placement(rng, ndim));
      }
      at::Tensor full = at::randn(shape, options(at::kDouble));
      INFO("case " << c << " " << mesh.to_string() << " shape " << full.sizes() << " "
                   << dtensor::to_string(src) << " -> " << dtensor::to_string(dst));
      DTensor source = DTensor::from_local(make_local(full, mesh, src), mesh, src, shape);
      REQUIRE(matches(source.full_tensor(), full));
      auto plan = dtensor::detail::plan_redistribute(source.spec(), dst);
      int64_t planned = 0;
      for (const auto& step : plan) {
        planned += step.communicates ? 1 : 0;
      }
      DTensor moved;
      {
        CommDebugMode mode;
        moved = source.redistribute(dst);
        REQUIRE(mode.total_count() == planned);
        if (mesh.ndim() == 1) {
          REQUIRE(mode.total_count() ==
                  over(mesh.size(), expected_1d(src[0].normalized(ndim), dst[0].normalized(ndim))));
        }
        collectives += mode.total_count();
      }
      REQUIRE(moved.to_local().sizes().vec() == moved.spec().local_shape());
      REQUIRE(matches(moved.full_tensor(), full));
      // Ops on the source (Partial inputs included) and on the result.
      for (const auto& op : all_ops) {
        check_op(op, source, full);
        check_op(op, moved, full);
        op_checks += 2;
      }
      ++cases;
    }
  }
  if (rank() == 0) {
    std::printf("random test: %d cases, %lld redistribution collectives, %lld op checks, world %d\n",
                cases, static_cast<long long>(collectives), static_cast<long long>(op_checks), world());
  }
  REQUIRE(cases >= 1000);
}
