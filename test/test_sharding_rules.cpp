// Sharding rules: for each op family, on 1-D and 2-D meshes, the DTensor result's
// full_tensor() equals the plain op on full tensors, its placements are the expected ones,
// and (where marked) gradients equal the plain gradients.
#include <functional>

#include "support/prelude.h"

namespace {

using Fn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

struct Input {
  at::Tensor full;
  Placements placements;
};

struct Case {
  std::string name;
  std::vector<Input> inputs;
  Fn fn;
  Placements expected;
  bool grad = false;
};

const Placement R = Placement::replicate();
const Placement P = Placement::partial();
Placement S(int64_t d) { return Placement::shard(d); }

at::Tensor rnd(std::vector<int64_t> shape) { return at::randn(shape, options(at::kDouble)); }

DTensor make(const Input& in, const dtensor::DeviceMesh& mesh) {
  // Partial inputs: distribute as Replicate, then partition (local, exact in double).
  Placements start;
  for (const auto& p : in.placements) {
    start.push_back(p.is_partial() ? R : p);
  }
  DTensor d = dtensor::distribute_tensor(in.full, mesh, start);
  return start == in.placements ? d : d.redistribute(in.placements);
}

void run(const Case& c, const dtensor::DeviceMesh& mesh) {
  INFO(c.name << " on " << mesh.to_string());
  std::vector<at::Tensor> full;
  std::vector<at::Tensor> dist;
  for (const auto& in : c.inputs) {
    at::Tensor f = in.full.clone();
    DTensor d = make(in, mesh);
    if (c.grad && at::isFloatingType(f.scalar_type())) {
      f.set_requires_grad(true);
      d.set_requires_grad(true);
    }
    full.push_back(f);
    dist.push_back(d);
  }
  at::Tensor want = c.fn(full);
  at::Tensor got = c.fn(dist);
  REQUIRE(dtensor::is_dtensor(got));
  REQUIRE(DTensor(got).placements() == c.expected);
  REQUIRE(close(DTensor(got).full_tensor(), want, 1e-9, 1e-9));
  if (c.grad) {
    at::Tensor w = at::randn(want.sizes(), options(at::kDouble));
    (want * w).sum().backward();
    DTensor wd = dtensor::distribute_tensor(w, mesh, Placements(static_cast<size_t>(mesh.ndim()), R));
    (got * wd).sum().backward();
    for (size_t i = 0; i < full.size(); ++i) {
      if (full[i].requires_grad()) {
        INFO("gradient of input " << i);
        REQUIRE(dtensor::is_dtensor(dist[i].grad()));
        REQUIRE(close(DTensor(dist[i].grad()).full_tensor(), full[i].grad(), 1e-9, 1e-9));
      }
    }
  }
}

std::vector<Case> one_d_cases() {
  std::vector<Case> cs;
  auto x = [] { return rnd({8, 12}); };
  // pointwise
  cs.push_back({"add S0+S0", {{x(), {S(0)}}, {x(), {S(0)}}}, [](auto& a) { return a[0] + a[1]; }, {S(0)}, true});
  cs.push_back({"add S0+R", {{x(), {S(0)}}, {x(), {R}}}, [](auto& a) { return a[0] + a[1]; }, {S(0)}, true});
  cs.push_back({"mul R*S1", {{x(), {R}}, {x(), {S(1)}}}, [](auto& a) { return a[0] * a[1]; }, {S(1)}, true});
  cs.push_back({"add P+P", {{x(), {P}}, {x(), {P}}}, [](auto& a) { return a[0] + a[1]; }, {P}});
  cs.push_back({"add P+R stays partial (R partitioned)", {{x(), {P}}, {x(), {R}}}, [](auto& a) { return a[0] + a[1]; }, {P}});
  cs.push_back({"sub R-P stays partial", {{x(), {R}}, {x(), {P}}}, [](auto& a) { return a[0] - a[1]; }, {P}});
  cs.push_back({"add_ in place P += R", {{x(), {P}}, {rnd({12}), {R}}}, [](auto& a) {
                  at::Tensor t = a[0].detach().clone();
                  t.add_(a[1]);
                  return t; }, {P}});
  cs.push_back({"mul P*R stays partial", {{x(), {P}}, {x(), {R}}}, [](auto& a) { return a[0] * a[1]; }, {P}});
  cs.push_back({"neg P", {{x(), {P}}}, [](auto& a) { return -a[0]; }, {P}});
  cs.push_back({"add P+scalar reduces", {{x(), {P}}}, [](auto& a) { return a[0] + 1.5; }, {R}});
  cs.push_back({"bias broadcast S1", {{x(), {S(1)}}, {rnd({12}), {R}}}, [](auto& a) { return a[0] + a[1]; }, {S(1)}, true});
  cs.push_back({"bias broadcast S0", {{x(), {S(0)}}, {rnd({12}), {R}}}, [](auto& a) { return a[0] + a[1]; }, {S(0)}, true});
  cs.push_back({"uneven S0 relu", {{rnd({7, 5}), {S(0)}}}, [](auto& a) { return at::relu(a[0]); }, {S(0)}, true});
  cs.push_back({"where", {{x(), {S(0)}}, {x(), {S(0)}}}, [](auto& a) { return at::where(a[0] > 0, a[0], a[1]); }, {S(0)}, true});
  cs.push_back({"addcmul", {{x(), {S(1)}}, {x(), {S(1)}}, {x(), {R}}}, [](auto& a) { return at::addcmul(a[0], a[1], a[2], 0.5); }, {S(1)}, true});
  cs.push_back({"tanh sigmoid exp", {{x(), {S(1)}}}, [](auto& a) { return at::tanh(a[0]) + at::sigmoid(a[0]) * at::exp(a[0]); }, {S(1)}, true});
  cs.push_back({"gelu silu", {{x(), {S(0)}}}, [](auto& a) { return at::gelu(a[0]) + at::silu(a[0]); }, {S(0)}, true});
  // reductions
  cs.push_back({"sum dim0 of S0", {{x(), {S(0)}}}, [](auto& a) { return a[0].sum(0); }, {P}, true});
  cs.push_back({"sum dim1 of S0", {{x(), {S(0)}}}, [](auto& a) { return a[0].sum(1); }, {S(0)}, true});
  cs.push_back({"sum keepdim", {{x(), {S(1)}}}, [](auto& a) { return a[0].sum({0}, true); }, {S(1)}, true});
  cs.push_back({"sum all", {{x(), {S(1)}}}, [](auto& a) { return a[0].sum(); }, {P}, true});
  cs.push_back({"mean even", {{x(), {S(0)}}}, [](auto& a) { return a[0].mean(0); }, {Placement::partial(dtensor::ReduceOp::Avg)}, true});
  // 7 rows split over 2 or 4 ranks: local means do not average to the mean, so gather.
  cs.push_back({"mean uneven gathers", {{rnd({7, 3}), {S(0)}}}, [](auto& a) { return a[0].mean(0); },
                {7 % world() == 0 ? Placement::partial(dtensor::ReduceOp::Avg) : R}, true});
  cs.push_back({"amax", {{x(), {S(0)}}}, [](auto& a) { return a[0].amax(0); }, {Placement::partial(dtensor::ReduceOp::Max)}});
  cs.push_back({"norm 2", {{x(), {S(0)}}}, [](auto& a) { return at::linalg_vector_norm(a[0], 2); }, {Placement::partial_norm(2)}, true});
  cs.push_back({"norm 3", {{x(), {S(1)}}}, [](auto& a) { return at::linalg_vector_norm(a[0], 3); }, {Placement::partial_norm(3)}});
  cs.push_back({"norm inf", {{x(), {S(0)}}}, [](auto& a) { return at::linalg_vector_norm(a[0], INFINITY); }, {Placement::partial_norm(INFINITY)}});
  cs.push_back({"norm 1 uneven", {{rnd({5, 3}), {S(0)}}}, [](auto& a) { return at::linalg_vector_norm(a[0], 1); }, {Placement::partial_norm(1)}});
  // matrix products
  auto a = [] { return rnd({8, 12}); };
  auto b = [] { return rnd({12, 4}); };
  cs.push_back({"mm S0 x R", {{a(), {S(0)}}, {b(), {R}}}, [](auto& v) { return at::mm(v[0], v[1]); }, {S(0)}, true});
  cs.push_back({"mm R x S1", {{a(), {R}}, {b(), {S(1)}}}, [](auto& v) { return at::mm(v[0], v[1]); }, {S(1)}, true});
  cs.push_back({"mm S1 x S0", {{a(), {S(1)}}, {b(), {S(0)}}}, [](auto& v) { return at::mm(v[0], v[1]); }, {P}, true});
  cs.push_back({"addmm", {{rnd({4}), {R}}, {a(), {S(0)}}, {b(), {R}}}, [](auto& v) { return at::addmm(v[0], v[1], v[2]); }, {S(0)}, true});
  cs.push_back({"matmul 3-D", {{rnd({4, 6, 12}), {S(0)}}, {b(), {R}}}, [](auto& v) { return at::matmul(v[0], v[1]); }, {S(0)}, true});
  cs.push_back({"bmm", {{rnd({4, 6, 12}), {S(0)}}, {rnd({4, 12, 2}), {S(0)}}}, [](auto& v) { return at::bmm(v[0], v[1]); }, {S(0)}, true});
  // views
  cs.push_back({"t", {{x(), {S(0)}}}, [](auto& v) { return v[0].t(); }, {S(1)}, true});
  cs.push_back({"transpose", {{rnd({4, 6, 8}), {S(2)}}}, [](auto& v) { return v[0].transpose(0, 2); }, {S(0)}, true});
  cs.push_back({"permute", {{rnd({4, 6, 8}), {S(1)}}}, [](auto& v) { return v[0].permute({2, 0, 1}); }, {S(2)}, true});
  cs.push_back({"view split", {{rnd({8, 6}), {S(0)}}}, [](auto& v) { return v[0].view({8, 2, 3}); }, {S(0)}, true});
  cs.push_back({"view merge", {{rnd({8, 6}), {S(0)}}}, [](auto& v) { return v[0].view({48}); }, {S(0)}, true});
  cs.push_back({"reshape keeps S1", {{rnd({4, 8, 3}), {S(1)}}}, [](auto& v) { return v[0].reshape({4, 8, 3, 1}); }, {S(1)}, true});
  cs.push_back({"unsqueeze", {{x(), {S(1)}}}, [](auto& v) { return v[0].unsqueeze(0); }, {S(2)}, true});
  cs.push_back({"squeeze", {{rnd({8, 1, 4}), {S(0)}}}, [](auto& v) { return v[0].squeeze(1); }, {S(0)}, true});
  cs.push_back({"expand", {{rnd({8, 1}), {S(0)}}}, [](auto& v) { return v[0].expand({8, 5}); }, {S(0)}, true});
  cs.push_back({"slice other dim", {{x(), {S(0)}}}, [](auto& v) { return v[0].slice(1, 2, 9); }, {S(0)}, true});
  cs.push_back({"select sharded dim", {{x(), {S(0)}}}, [](auto& v) { return v[0].select(0, 3); }, {R}, true});
  // nn
  cs.push_back({"softmax", {{x(), {S(0)}}}, [](auto& v) { return at::softmax(v[0], -1); }, {S(0)}, true});
  cs.push_back({"log_softmax on sharded dim", {{x(), {S(1)}}}, [](auto& v) { return at::log_softmax(v[0], 1); }, {R}, true});
  cs.push_back({"layer_norm", {{rnd({8, 3, 12}), {S(0)}}, {rnd({12}), {R}}, {rnd({12}), {R}}},
                [](auto& v) { return at::layer_norm(v[0], {12}, v[1], v[2]); }, {S(0)}, true});
  cs.push_back({"cross_entropy", {{x(), {S(0)}}}, [](auto& v) {
                  auto target = at::arange(8, options(at::kLong)) % 12;
                  auto t = dtensor::is_dtensor(v[0]) ? at::Tensor(dtensor::distribute_tensor(target, DTensor(v[0]).device_mesh(), {R}))
                                                     : target;
                  return at::cross_entropy_loss(v[0], t); }, {R}, true});
  cs.push_back({"rms_norm", {{rnd({8, 3, 12}), {S(0)}}, {rnd({12}), {R}}},
                [](auto& v) { return at::rms_norm(v[0], {12}, v[1], 1e-6); }, {S(0)}, true});
  auto ids = [] { return at::randint(0, 10, {8, 3}, options(at::kLong)); };
  cs.push_back({"embedding, sharded indices", {{rnd({10, 12}), {R}}, {ids(), {S(0)}}},
                [](auto& v) { return at::embedding(v[0], v[1]); }, {S(0)}, true});
  cs.push_back({"embedding, column-sharded weight", {{rnd({10, 12}), {S(1)}}, {ids(), {R}}},
                [](auto& v) { return at::embedding(v[0], v[1]); }, {S(2)}, true});
  // lists
  cs.push_back({"cat", {{x(), {S(0)}}, {x(), {S(0)}}}, [](auto& v) { return at::cat({v[0], v[1]}, 1); }, {S(0)}, true});
  cs.push_back({"stack", {{x(), {S(1)}}, {x(), {S(1)}}}, [](auto& v) { return at::stack({v[0], v[1]}, 0); }, {S(2)}, true});
  // Every piece is used: autograd fills the gradient of an unused piece with a plain zeros
  // tensor, which cat then refuses to mix with DTensors (docs/dtensor.md, "Not yet").
  cs.push_back({"split", {{x(), {S(0)}}}, [](auto& v) { auto p = v[0].split(4, 1); return p[0] + p[1] * p[2]; }, {S(0)}, true});
  cs.push_back({"chunk", {{x(), {S(1)}}}, [](auto& v) { auto c = v[0].chunk(2, 0); return c[0] - c[1]; }, {S(1)}, true});
  // tensor ops
  cs.push_back({"clone", {{x(), {S(1)}}}, [](auto& v) { return v[0].clone(); }, {S(1)}, true});
  cs.push_back({"zeros_like of P", {{x(), {P}}}, [](auto& v) { return at::ones_like(v[0]); }, {R}});
  cs.push_back({"zero_ fill_ copy_", {{x(), {S(0)}}, {x(), {R}}}, [](auto& v) {
                  at::Tensor zeros = v[0].detach().clone();
                  at::Tensor filled = v[0].detach().clone();
                  zeros.zero_();
                  filled.fill_(2.5);
                  at::Tensor copied = at::empty_like(v[0]);
                  copied.copy_(v[1]);
                  return zeros + filled + copied; }, {S(0)}});
  cs.push_back({"to double", {{rnd({4, 4}).to(at::kFloat), {S(0)}}}, [](auto& v) { return v[0].to(at::kDouble); }, {S(0)}});
  return cs;
}

} // namespace

TEST_CASE("sharding rules on a 1-D mesh", "[dtensor][rules][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  at::manual_seed(11);
  int n = 0;
  for (const auto& c : one_d_cases()) {
    run(c, mesh);
    ++n;
  }
  REQUIRE(n > 50);
}

TEST_CASE("dropout on DTensors", "[dtensor][rules][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  at::Tensor full = at::rand({8, 6}, options(at::kDouble)) + 1;
  for (const Placements& p : {Placements{S(0)}, Placements{R}}) {
    at::manual_seed(5); // the same generator state on every rank
    DTensor x = dtensor::distribute_tensor(full, mesh, p);
    at::Tensor y = at::dropout(x, 0.5, /*train=*/true);
    REQUIRE(DTensor(y).placements() == p);
    at::Tensor out = DTensor(y).full_tensor();
    // Every element is dropped (0) or kept and scaled by 1 / (1 - p) = 2.
    REQUIRE(at::logical_or(out == 0, at::isclose(out, full * 2)).all().item<bool>());
    if (p[0].is_replicate()) {
      // Replicate stays consistent: every rank drew the same mask.
      auto gathered = dtensor::all_gather_tensor(DTensor(y).to_local().contiguous(), 0, mesh.get_group());
      for (int r = 1; r < world(); ++r) {
        REQUIRE(at::equal(gathered.chunk(world(), 0)[r], gathered.chunk(world(), 0)[0]));
      }
    }
    REQUIRE(dtensor::testing::same(DTensor(at::dropout(x, 0.5, /*train=*/false)).full_tensor(), full));
  }
}

TEST_CASE("dtype casts that name the mesh's device (as autograd's do)",
          "[dtensor][rules][world1][world2][world4]") {
  // Autograd casts a gradient back to its input's dtype with the full TensorOptions, device
  // included ([Note: _to_copy with a device]); mixed-precision backward depends on it.
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  at::Tensor full = at::rand({8, 6}, options());
  DTensor x = dtensor::distribute_tensor(full, mesh, {S(0)});
  at::Tensor y = x.to(options(at::kHalf)); // dtype and this device
  REQUIRE(y.scalar_type() == at::kHalf);
  REQUIRE(DTensor(y).placements() == Placements{S(0)});
  REQUIRE(at::equal(DTensor(y).full_tensor(), full.to(at::kHalf)));
  // A gradient in fp32 flows back through a cast to fp16.
  at::Tensor leaf = dtensor::distribute_tensor(full, mesh, {S(0)}).detach().requires_grad_(true);
  at::Tensor half = leaf.to(at::kHalf);
  (DTensor(half).full_tensor().to(at::kFloat) * 2).sum().backward();
  REQUIRE(leaf.grad().scalar_type() == at::kFloat);
  REQUIRE(at::equal(DTensor(leaf.grad()).full_tensor(), at::full({8, 6}, 2.0, options())));
}

TEST_CASE("sharding rules on a 2-D mesh", "[dtensor][rules][world4]") {
  auto mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
  at::manual_seed(12);
  auto x = [] { return rnd({8, 12}); };
  std::vector<Case> cs;
  cs.push_back({"add (S0,S1)", {{x(), {S(0), S(1)}}, {x(), {S(0), R}}}, [](auto& a) { return a[0] + a[1]; }, {S(0), S(1)}, true});
  cs.push_back({"mm (S0,R)x(R,S1)", {{x(), {S(0), R}}, {rnd({12, 4}), {R, S(1)}}}, [](auto& a) { return at::mm(a[0], a[1]); }, {S(0), S(1)}, true});
  cs.push_back({"mm (R,S1)x(R,S0)", {{x(), {R, S(1)}}, {rnd({12, 4}), {R, S(0)}}}, [](auto& a) { return at::mm(a[0], a[1]); }, {R, P}, true});
  cs.push_back({"sum nested S0,S0", {{x(), {S(0), S(0)}}}, [](auto& a) { return a[0].sum(0); }, {P, P}, true});
  cs.push_back({"norm 2 (S0,S1)", {{x(), {S(0), S(1)}}}, [](auto& a) { return at::linalg_vector_norm(a[0], 2); },
                {Placement::partial_norm(2), Placement::partial_norm(2)}});
  cs.push_back({"t (S0,S1)", {{x(), {S(0), S(1)}}}, [](auto& a) { return a[0].t(); }, {S(1), S(0)}, true});
  cs.push_back({"softmax (S0,S1) on dim 1", {{x(), {S(0), S(1)}}}, [](auto& a) { return at::softmax(a[0], 1); }, {S(0), R}, true});
  for (const auto& c : cs) {
    run(c, mesh);
  }
}

TEST_CASE("_foreach_ ops run element by element on differently sharded lists",
          "[dtensor][rules][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  const at::Tensor a = at::arange(24, options()).view({4, 6}) / 5.0;
  const at::Tensor b = at::arange(12, options()).view({6, 2}) / 3.0;
  // Parameters sharded differently, as fully_shard and TP leave them.
  std::vector<at::Tensor> xs{dtensor::distribute_tensor(a, mesh, {Placement::shard(0)}),
                             dtensor::distribute_tensor(b, mesh, {Placement::shard(1)})};
  std::vector<at::Tensor> ys{dtensor::distribute_tensor(a * 2, mesh, {Placement::shard(0)}),
                             dtensor::distribute_tensor(b - 1, mesh, {Placement::shard(1)})};
  CommDebugMode mode;
  std::vector<at::Tensor> sums = at::_foreach_add(xs, ys, 0.5);
  std::vector<at::Tensor> scaled = at::_foreach_mul(xs, at::ArrayRef<at::Scalar>{2.0, -1.0});
  at::_foreach_addcmul_(xs, ys, ys, 0.25);
  REQUIRE(mode.total_count() == 0); // every element keeps its own shards
  REQUIRE(DTensor(sums[1]).placements() == Placements{Placement::shard(1)});
  REQUIRE(close(DTensor(sums[0]).full_tensor(), a + 0.5 * (a * 2)));
  REQUIRE(close(DTensor(sums[1]).full_tensor(), b + 0.5 * (b - 1)));
  REQUIRE(close(DTensor(scaled[0]).full_tensor(), a * 2.0));
  REQUIRE(close(DTensor(scaled[1]).full_tensor(), b * -1.0));
  REQUIRE(close(DTensor(xs[0]).full_tensor(), a + 0.25 * (a * 2) * (a * 2)));
  REQUIRE(close(DTensor(xs[1]).full_tensor(), b + 0.25 * (b - 1) * (b - 1)));
}

// [Note: convolution layouts]: batch shards and output-channel shards stay local, values and
// gradients as the plain convolution; other shards are gathered.
TEST_CASE("convolution on DTensors", "[dtensor][rules][conv][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  at::manual_seed(21);
  const at::Tensor img = rnd({4, 4, 6, 5});
  const at::Tensor w = rnd({8, 4, 3, 3});
  const at::Tensor b = rnd({8});
  auto conv = [](auto& a) { return at::conv2d(a[0], a[1], a[2], {2, 1}, {1, 0}); };
  std::vector<Case> cs;
  cs.push_back({"conv2d batch", {{img, {S(0)}}, {w, {R}}, {b, {R}}}, conv, {S(0)}, true});
  cs.push_back({"conv2d out channels", {{img, {R}}, {w, {S(0)}}, {b, {S(0)}}}, conv, {S(1)}, true});
  cs.push_back({"conv2d in channels gathered", {{img, {S(1)}}, {w, {R}}, {b, {R}}}, conv, {R}, true});
  cs.push_back({"conv2d groups", {{img, {R}}, {w.narrow(1, 0, 2), {S(0)}}, {b, {R}}},
                [](auto& a) { return at::conv2d(a[0], a[1], a[2], 1, 1, 1, 2); }, {R}, true});
  cs.push_back({"conv_transpose1d batch", {{rnd({4, 8, 7}), {S(0)}}, {rnd({8, 3, 2}), {R}}},
                [](auto& a) { return at::conv_transpose1d(a[0], a[1], {}, 2, 1, 1); }, {S(0)}, true});
  cs.push_back({"conv1d unbatched out channels", {{rnd({4, 9}), {R}}, {rnd({8, 4, 3}), {S(0)}}},
                [](auto& a) { return at::conv1d(a[0], a[1]); }, {S(0)}, true});
  for (const auto& c : cs) {
    run(c, mesh);
  }
  if (world() == 4) {
    auto m2 = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
    run({"conv2d batch x out channels", {{img, {S(0), R}}, {w, {R, S(0)}}, {b, {R, S(0)}}}, conv,
         {S(0), S(1)}, true},
        m2);
    CommDebugMode mode;
    DTensor x = dtensor::distribute_tensor(img, m2, {S(0), R});
    DTensor k = dtensor::distribute_tensor(w, m2, {R, S(0)});
    mode.reset();
    DTensor y(at::conv2d(x, k));
    REQUIRE(mode.total_count() == 0);
    REQUIRE(y.placements() == Placements{S(0), S(1)});
  }
}

// [Note: in-place view ops]: the DTensor takes the view's spec; other handles keep theirs.
TEST_CASE("in-place view ops on DTensors", "[dtensor][rules][views][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  const at::Tensor x = at::arange(32, options()).view({4, 1, 8}) / 3.0;
  DTensor d = dtensor::distribute_tensor(x, mesh, {S(2)});
  const at::Tensor alias = d.detach();
  CommDebugMode mode;
  d.squeeze_(1);
  REQUIRE(d.sizes().vec() == std::vector<int64_t>{4, 8});
  REQUIRE(d.placements() == Placements{S(1)});
  REQUIRE(d.to_local().sizes().vec() == std::vector<int64_t>{4, 8 / world()});
  REQUIRE(close(d.full_tensor(), x.squeeze(1)));
  REQUIRE(alias.sizes().vec() == std::vector<int64_t>{4, 1, 8});
  REQUIRE(DTensor(alias).placements() == Placements{S(2)});
  mode.reset();
  d.unsqueeze_(0);
  REQUIRE(d.placements() == Placements{S(2)});
  d.transpose_(0, 2);
  REQUIRE(d.sizes().vec() == std::vector<int64_t>{8, 4, 1});
  REQUIRE(d.placements() == Placements{S(0)});
  d.squeeze_();
  d.t_();
  REQUIRE(d.placements() == Placements{S(1)});
  REQUIRE(mode.total_count() == 0);
  REQUIRE(close(d.full_tensor(), x.squeeze(1)));
  REQUIRE(close(DTensor(alias).full_tensor(), x)); // the same data, its own view
}
