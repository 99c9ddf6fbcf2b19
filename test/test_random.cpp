// Layout-independent random numbers ([Note: layout-independent random numbers]) and the
// DTensor factories. Judges: ATen's own Philox engine (at::philox_engine) with the
// distributions computed here in scalar code, for the values; the same draw on every mesh,
// world size and placement (Shard on each dim, Replicate, uneven and empty shards) for the
// layout independence; the plain op on the full tensor for dropout's autograd.
#include <cmath>
#include <functional>

#include <ATen/core/PhiloxRNGEngine.h>
#include <torch/torch.h>

#include "support/prelude.h"
#include "tensor/random/philox.h"
#include "tensor/random/sample.h"

namespace {

using dtensor::detail::Distribution;

constexpr uint64_t kSeed = 20261125;

// The four words of element `i` of draw `offset`, from ATen's engine.
std::array<uint32_t, 4> aten_words(uint64_t seed, uint64_t i, uint64_t offset) {
  at::Philox4_32 engine(seed, i, offset);
  return {engine(), engine(), engine(), engine()};
}

double u53(uint32_t hi, uint32_t lo) {
  return static_cast<double>(((uint64_t{hi} >> 5) << 26) + (uint64_t{lo} >> 6)) * std::ldexp(1.0, -53);
}

// The full tensor of draw `offset` for `shape`, computed here element by element.
at::Tensor reference(const std::vector<int64_t>& shape, uint64_t offset, const Distribution& d,
                     at::ScalarType dtype) {
  const int64_t n = c10::multiply_integers(shape);
  at::Tensor out = at::empty({n}, at::kDouble);
  auto* v = out.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    auto w = aten_words(kSeed, static_cast<uint64_t>(i), offset);
    const double u = u53(w[0], w[1]);
    switch (d.kind) {
    case Distribution::kUniform: v[i] = u * (d.b - d.a) + d.a; break;
    case Distribution::kBernoulli: v[i] = u < d.a ? 1.0 : 0.0; break;
    case Distribution::kNormal:
      v[i] = std::cos(u53(w[2], w[3]) * 2.0 * M_PI) * std::sqrt(std::log(1.0 - u) * -2.0) * d.b + d.a;
      break;
    case Distribution::kRandom: {
      const uint64_t bits = (uint64_t{w[0] & 0x7FFFFFFFU} << 32) | w[1];
      v[i] = static_cast<double>(d.from + static_cast<int64_t>(bits % d.range));
      break;
    }
    default: FAIL("no reference for " << d.name());
    }
  }
  return out.to(dtype).view(shape);
}

// Every placement list over `mesh` for a tensor of `ndim` dims: Replicate or Shard(d) per
// mesh dim.
std::vector<Placements> all_placements(const DeviceMesh& mesh, int64_t ndim) {
  std::vector<Placements> out{{}};
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    std::vector<Placements> next;
    for (const auto& prefix : out) {
      for (int64_t d = -1; d < ndim; ++d) {
        Placements p = prefix;
        p.push_back(d < 0 ? Placement::replicate() : Placement::shard(d));
        next.push_back(p);
      }
    }
    out = next;
  }
  return out;
}

std::vector<DeviceMesh> meshes() { return dtensor::testing::property_meshes(); }

struct RandomOp {
  const char* name;
  std::function<void(at::Tensor&)> apply; // on a DTensor or a plain tensor
};

// The ops of the grid, each one draw (offset k for the k-th).
std::vector<RandomOp> grid_ops() {
  return {
      {"normal_(0.5, 2)", [](at::Tensor& t) { t.normal_(0.5, 2.0); }},
      {"uniform_(-1, 3)", [](at::Tensor& t) { t.uniform_(-1.0, 3.0); }},
      {"bernoulli_(0.3)", [](at::Tensor& t) { t.bernoulli_(0.3); }},
      {"random_(5, 17)", [](at::Tensor& t) { t.random_(5, 17); }},
      {"exponential_(2)", [](at::Tensor& t) { t.exponential_(2.0); }},
      {"log_normal_(0, 0.5)", [](at::Tensor& t) { t.log_normal_(0.0, 0.5); }},
      {"cauchy_(1, 2)", [](at::Tensor& t) { t.cauchy_(1.0, 2.0); }},
      {"geometric_(0.25)", [](at::Tensor& t) { t.geometric_(0.25); }},
      {"bernoulli(probs)", [](at::Tensor& t) { t = at::bernoulli(t.fill_(0.35)); }},
      {"bernoulli_(probs)", [](at::Tensor& t) { t.bernoulli_(at::full_like(t, 0.6)); }},
      {"bernoulli(self, 0.7)", [](at::Tensor& t) { t = at::bernoulli(t, 0.7); }},
  };
}

} // namespace

TEST_CASE("random: Philox words equal ATen's engine, on the CPU loop and in tensor ops",
          "[random][world1]") {
  at::Tensor index = at::tensor({int64_t{0}, int64_t{1}, int64_t{7}, int64_t{4095}, int64_t{1} << 32,
                                 (int64_t{1} << 40) + 3, (int64_t{1} << 62) + 12345},
                                at::kLong);
  for (uint64_t offset : {uint64_t{0}, uint64_t{1}, uint64_t{0xFFFFFFFF}, uint64_t{1} << 33}) {
    for (uint64_t seed : {uint64_t{0}, kSeed, uint64_t{0xDEADBEEFCAFEF00D}}) {
      auto loop = dtensor::detail::philox_words(index, seed, offset);
      auto ops = dtensor::detail::philox_words_by_ops(index, seed, offset);
      for (int64_t k = 0; k < index.numel(); ++k) {
        auto want = aten_words(seed, static_cast<uint64_t>(index[k].item<int64_t>()), offset);
        for (int w = 0; w < 4; ++w) {
          INFO("seed " << seed << " offset " << offset << " element " << k << " word " << w);
          REQUIRE(loop[w][k].item<int64_t>() == int64_t{want[w]});
          REQUIRE(ops[w][k].item<int64_t>() == int64_t{want[w]});
        }
      }
    }
  }
}

TEST_CASE("random: the GPU path (tensor ops) run on CPU agrees with the CPU path",
          "[random][world1]") {
  at::Tensor index = at::arange(int64_t{1} << 32, (int64_t{1} << 32) + 5000, at::kLong);
  const dtensor::detail::Draw draw{kSeed, 9};
  for (const Distribution& d :
       {Distribution{Distribution::kUniform, -2.0, 5.0}, Distribution{Distribution::kBernoulli, 0.4},
        Distribution{Distribution::kNormal, 1.0, 3.0}, Distribution{Distribution::kExponential, 1.5},
        Distribution{Distribution::kLogNormal, 0.0, 0.25}, Distribution{Distribution::kCauchy, 0.0, 1.0},
        Distribution{Distribution::kGeometric, 0.3},
        Distribution{Distribution::kRandom, 0.0, 0.0, -3, 1000}}) {
    INFO(d.name());
    at::Tensor cpu = dtensor::detail::draw_values(index, draw, d);
    at::Tensor ops = dtensor::detail::draw_values_by_ops(index, draw, d);
    const bool exact = d.kind == Distribution::kUniform || d.kind == Distribution::kBernoulli ||
                       d.kind == Distribution::kRandom;
    if (exact) {
      REQUIRE(same(cpu, ops));
    } else {
      // Only the last bits of libm against SLEEF may differ.
      REQUIRE(at::allclose(cpu, ops, 1e-12, 1e-12));
    }
  }
}

TEST_CASE("random: every op gives the same full tensor on every mesh and placement",
          "[random][world1][world2][world4][world8]") {
  const std::vector<std::vector<int64_t>> shapes{{7, 5}, {3, 0}, {9}};
  const auto ops = grid_ops();
  std::vector<std::vector<at::Tensor>> first(shapes.size(), std::vector<at::Tensor>(ops.size()));
  for (const auto& mesh : meshes()) {
    for (size_t s = 0; s < shapes.size(); ++s) {
      const auto& shape = shapes[s];
      for (const auto& placements : all_placements(mesh, static_cast<int64_t>(shape.size()))) {
        dtensor::manual_seed(kSeed, mesh);
        for (size_t k = 0; k < ops.size(); ++k) {
          INFO(ops[k].name << " on " << shape << " " << dtensor::to_string(placements) << " over "
                           << mesh.to_string());
          at::Tensor t = dtensor::empty(shape, mesh, placements, options(at::kDouble));
          ops[k].apply(t);
          at::Tensor full = DTensor(t).full_tensor();
          REQUIRE(full.sizes().vec() == shape);
          if (!first[s][k].defined()) {
            first[s][k] = full;
          }
          REQUIRE(same(full, first[s][k])); // bit for bit
        }
        REQUIRE(dtensor::get_rng_state().offset == ops.size());
      }
    }
  }
  // Against the values computed here from ATen's engine (offset k: the k-th op).
  for (size_t s = 0; s < shapes.size(); ++s) {
    REQUIRE(close(first[s][0], reference(shapes[s], 0, {Distribution::kNormal, 0.5, 2.0}, at::kDouble),
                  1e-12, 1e-12));
    REQUIRE(same(first[s][1], reference(shapes[s], 1, {Distribution::kUniform, -1.0, 3.0}, at::kDouble)));
    REQUIRE(same(first[s][2], reference(shapes[s], 2, {Distribution::kBernoulli, 0.3}, at::kDouble)));
    REQUIRE(same(first[s][3],
                      reference(shapes[s], 3, {Distribution::kRandom, 0, 0, 5, 12}, at::kDouble)));
  }
}

TEST_CASE("random: replicas are equal, shards differ, the values have their distribution",
          "[random][world1][world2][world4][world8]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  dtensor::manual_seed(kSeed, mesh);
  DTensor r = dtensor::randn({world() * 64, 64}, mesh, {Placement::shard(0)});
  at::Tensor full = r.full_tensor();
  // Shards are not copies of each other.
  for (int64_t a = 1; a < world(); ++a) {
    REQUIRE_FALSE(same(full.narrow(0, 0, 64), full.narrow(0, a * 64, 64)));
  }
  REQUIRE(std::abs(full.mean().item<double>()) < 0.05);
  REQUIRE(std::abs(full.std().item<double>() - 1.0) < 0.05);
  // Replicate: every rank holds the same values, the full tensor of the same draw.
  dtensor::manual_seed(kSeed, mesh);
  DTensor rep = dtensor::randn({world() * 64, 64}, mesh, {Placement::replicate()});
  REQUIRE(same(rep.to_local(), full));
  at::Tensor u = dtensor::rand({4096}, mesh, {Placement::shard(0)}).full_tensor();
  REQUIRE(u.min().item<double>() >= 0.0);
  REQUIRE(u.max().item<double>() < 1.0);
  REQUIRE(std::abs(u.mean().item<double>() - 0.5) < 0.02);
  at::Tensor b = dtensor::empty({4096}, mesh, {Placement::shard(0)}).bernoulli_(0.25);
  REQUIRE(std::abs(DTensor(b).full_tensor().mean().item<double>() - 0.25) < 0.03);
}

TEST_CASE("random: without manual_seed the draws follow torch::manual_seed",
          "[random][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  dtensor::set_rng_state({}); // not seeded: LibTorch's default CPU generator is followed
  torch::manual_seed(5);
  at::Tensor a = dtensor::randn({6, 3}, mesh, {Placement::shard(0)}).full_tensor();
  at::Tensor b = dtensor::randn({6, 3}, mesh, {Placement::shard(0)}).full_tensor();
  REQUIRE_FALSE(same(a, b));
  torch::manual_seed(5); // reseeding restarts the sequence, in another layout
  REQUIRE(same(dtensor::randn({6, 3}, mesh, {Placement::shard(1)}).full_tensor(), a));
  REQUIRE(same(dtensor::randn({6, 3}, mesh, {Placement::replicate()}).full_tensor(), b));
  // The plain reference follows the same rule.
  torch::manual_seed(5);
  at::Tensor plain = at::empty({6, 3});
  dtensor::normal_(plain);
  REQUIRE(same(plain, a));
  // A CPU generator passed to the op is followed instead.
  at::Generator gen = at::detail::createCPUGenerator(77);
  at::Tensor g1 = dtensor::empty({6, 3}, mesh, {Placement::shard(0)}).normal_(0.0, 1.0, gen);
  gen.set_current_seed(77);
  at::Tensor g2 = dtensor::empty({6, 3}, mesh, {Placement::replicate()}).normal_(0.0, 1.0, gen);
  REQUIRE(same(DTensor(g1).full_tensor(), DTensor(g2).full_tensor()));
  dtensor::manual_seed(kSeed, mesh);
}

TEST_CASE("random: the plain-tensor reference and rng state save / restore",
          "[random][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  dtensor::manual_seed(kSeed, mesh);
  const dtensor::RngState saved = dtensor::get_rng_state();
  DTensor d = dtensor::empty({5, 4}, mesh, {Placement::shard(1)});
  d.uniform_(-2.0, 2.0);
  dtensor::set_rng_state(saved);
  at::Tensor plain = at::empty({5, 4});
  dtensor::uniform_(plain, -2.0, 2.0);
  REQUIRE(same(d.full_tensor(), plain));
  // trunc_normal_ stays inside its bounds and is layout-independent.
  dtensor::set_rng_state(saved);
  at::Tensor tn = dtensor::empty({64, 8}, mesh, {Placement::shard(0)});
  dtensor::trunc_normal_(tn, 0.0, 1.0, -0.5, 0.5);
  dtensor::set_rng_state(saved);
  at::Tensor tn_plain = at::empty({64, 8});
  dtensor::trunc_normal_(tn_plain, 0.0, 1.0, -0.5, 0.5);
  at::Tensor tn_full = DTensor(tn).full_tensor();
  REQUIRE(close(tn_full, tn_plain, 1e-6, 1e-6));
  REQUIRE(tn_full.min().item<double>() >= -0.5);
  REQUIRE(tn_full.max().item<double>() <= 0.5);
}

TEST_CASE("random: dropout on DTensors equals dropout of the full tensor, gradients too",
          "[random][world1][world2][world4][world8]") {
  for (const auto& mesh : meshes()) {
    for (const auto& placements : all_placements(mesh, 2)) {
      INFO(dtensor::to_string(placements) << " over " << mesh.to_string());
      at::Tensor x = at::arange(1.0, 1.0 + 6 * 10, at::kDouble).view({6, 10});
      dtensor::manual_seed(kSeed, mesh);
      at::Tensor xd = dtensor::distribute_tensor(x, mesh, placements).detach().requires_grad_(true);
      at::Tensor yd = dtensor::dropout(xd, 0.4, /*train=*/true);
      (yd * yd).sum().backward();
      dtensor::manual_seed(kSeed, mesh);
      at::Tensor xp = x.clone().requires_grad_(true);
      at::Tensor yp = dtensor::dropout(xp, 0.4, /*train=*/true);
      (yp * yp).sum().backward();
      REQUIRE(same(DTensor(yd).full_tensor(), yp.detach()));
      REQUIRE(same(DTensor(xd.grad()).full_tensor(), xp.grad()));
      const double kept = (yp != 0).to(at::kDouble).mean().item<double>();
      REQUIRE(kept > 0.3);
      REQUIRE(kept < 0.9);
      // Not training: the input, no draw.
      const auto before = dtensor::get_rng_state().offset;
      REQUIRE(same(DTensor(dtensor::dropout(xd, 0.4, false)).full_tensor(), x));
      REQUIRE(dtensor::get_rng_state().offset == before);
    }
  }
}

TEST_CASE("random: a BatchShardGuard makes a batch slice draw the global batch's rows",
          "[random][world1][world2][world4][world8]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  const int64_t b = 3;
  dtensor::manual_seed(kSeed, mesh);
  at::Tensor global = at::ones({b * world(), 4, 5});
  at::Tensor want = dtensor::dropout(global, 0.5, true);
  dtensor::manual_seed(kSeed, mesh);
  at::Tensor got;
  {
    dtensor::BatchShardGuard guard(mesh);
    got = dtensor::dropout(at::ones({b, 4, 5}), 0.5, true);
  }
  REQUIRE(same(got, want.narrow(0, rank() * b, b)));
}

TEST_CASE("factories: local shards only, values, placements, errors",
          "[factories][world1][world2][world4][world8]") {
  for (const auto& mesh : meshes()) {
    for (const auto& placements : all_placements(mesh, 2)) {
      INFO(dtensor::to_string(placements) << " over " << mesh.to_string());
      const std::vector<int64_t> shape{5, 3};
      DTensor z = dtensor::zeros(shape, mesh, placements);
      REQUIRE(z.sizes().vec() == shape);
      REQUIRE(z.placements() == placements);
      REQUIRE(z.to_local().sizes().vec() == z.spec().local_shape());
      REQUIRE(same(z.full_tensor(), at::zeros(shape)));
      REQUIRE(same(dtensor::ones(shape, mesh, placements).full_tensor(), at::ones(shape)));
      DTensor f = dtensor::full(shape, 2.5, mesh, placements, options(at::kDouble).requires_grad(true));
      REQUIRE(f.requires_grad());
      REQUIRE(f.scalar_type() == at::kDouble);
      REQUIRE(same(DTensor(f.detach()).full_tensor(), at::full(shape, 2.5, at::kDouble)));
      REQUIRE(dtensor::empty(shape, mesh, placements).to_local().sizes().vec() ==
              dtensor::DTensor(z).spec().local_shape());
    }
    // Default placements: Replicate on every mesh dim.
    DTensor d = dtensor::ones({4}, mesh);
    REQUIRE(d.placements() == Placements(static_cast<size_t>(mesh.ndim()), Placement::replicate()));
    // rand / randn do not depend on the layout.
    dtensor::manual_seed(kSeed, mesh);
    at::Tensor r1 = dtensor::rand({6, 4}, mesh, Placements(mesh.ndim(), Placement::shard(1))).full_tensor();
    dtensor::manual_seed(kSeed, mesh);
    at::Tensor r2 = dtensor::rand({6, 4}, mesh).full_tensor();
    REQUIRE(same(r1, r2));
    // Errors name what was wrong.
    REQUIRE_THROWS_WITH(dtensor::zeros({4}, mesh, Placements(mesh.ndim() + 1, Placement::replicate())),
                        contains("placements"));
    REQUIRE_THROWS_WITH(
        dtensor::ones({4}, mesh, Placements(mesh.ndim(), Placement::partial(ReduceOp::Sum))),
        contains("Partial(sum)"));
    REQUIRE_THROWS_WITH(dtensor::zeros({4, -1}, mesh), contains("negative dimension"));
    REQUIRE_THROWS_WITH(dtensor::randn({4}, mesh, {}, options(at::kLong)),
                        contains("floating dtype"));
    REQUIRE_THROWS_WITH(dtensor::zeros({4}, mesh, {}, at::TensorOptions().device(at::kMeta)),
                        contains("not of the mesh's type"));
    // Partial placements that keep a constant are fine.
    DTensor m = dtensor::ones({4}, mesh, Placements(mesh.ndim(), Placement::partial(ReduceOp::Max)));
    REQUIRE(same(m.full_tensor(), at::ones({4})));
    DTensor zs = dtensor::zeros({4}, mesh, Placements(mesh.ndim(), Placement::partial(ReduceOp::Sum)));
    REQUIRE(same(zs.full_tensor(), at::zeros({4})));
  }
}

TEST_CASE("random: refusals name the op and the placements", "[random][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  DTensor p = dtensor::zeros({4, 4}, mesh, {Placement::partial(ReduceOp::Sum)});
  REQUIRE_THROWS_WITH(at::Tensor(p).normal_(), contains("aten::normal_") &&
                                                    contains("Partial"));
  DTensor s = dtensor::zeros({4, 4}, mesh, {Placement::shard(0)});
  REQUIRE_THROWS_WITH(at::Tensor(s).uniform_(2.0, 1.0), contains("from <= to"));
  REQUIRE_THROWS_WITH(at::Tensor(s).bernoulli_(1.5), contains("0 <= p <= 1"));
}
