// Collectives of the choke point, on every dimension of 1-D and 2-D meshes, against values
// computed by hand.
#include <numeric>

#include "support/prelude.h"

using dtensor::testing::tensor;

namespace {

// The meshes every collective is checked on: the 1-D world mesh, and for 4 ranks both
// dimensions of a (2, 2) mesh; for 2 ranks both dimensions of a (1, 2) mesh.
std::vector<dtensor::Group> groups_under_test() {
  std::vector<dtensor::Group> groups{init_device_mesh(device_type(), {world()}, {"w"}).get_group()};
  if (world() == 4) {
    auto mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
    groups.push_back(mesh.get_group("dp"));
    groups.push_back(mesh.get_group("tp"));
  } else if (world() == 2) {
    auto mesh = init_device_mesh(device_type(), {1, 2}, {"dp", "tp"});
    groups.push_back(mesh.get_group("dp"));
    groups.push_back(mesh.get_group("tp"));
  }
  return groups;
}

// Group rank g contributes (g + 1) * [1, 10, 100].
at::Tensor contribution(const dtensor::Group& g, at::ScalarType dtype = at::kFloat) {
  double v = g.rank() + 1;
  return tensor({v, 10 * v, 100 * v}, dtype);
}

at::Tensor scaled(double s) { return tensor({s, 10 * s, 100 * s}); }

} // namespace

TEST_CASE("all_reduce: every op on every mesh dimension", "[collectives][world1][world2][world4]") {
  for (const auto& g : groups_under_test()) {
    INFO(g.to_string());
    double n = g.size();
    double factorial = 1;
    for (int i = 2; i <= g.size(); ++i) {
      factorial *= i;
    }
    auto t = contribution(g);
    dtensor::all_reduce_(t, ReduceOp::Sum, g);
    CHECK(same(t, scaled(n * (n + 1) / 2)));
    t = contribution(g);
    dtensor::all_reduce_(t, ReduceOp::Avg, g);
    CHECK(at::allclose(t.cpu(), scaled((n + 1) / 2).cpu()));
    t = contribution(g);
    dtensor::all_reduce_(t, ReduceOp::Max, g);
    CHECK(same(t, scaled(n)));
    t = contribution(g);
    dtensor::all_reduce_(t, ReduceOp::Min, g);
    CHECK(same(t, scaled(1)));
    auto p = tensor({static_cast<double>(g.rank() + 1)});
    dtensor::all_reduce_(p, ReduceOp::Product, g);
    CHECK(p.item<float>() == static_cast<float>(factorial));
    // Functional form leaves its input alone.
    auto in = contribution(g, at::kDouble);
    auto out = dtensor::all_reduce(in, ReduceOp::Sum, g);
    CHECK(same(in, contribution(g, at::kDouble)));
    CHECK(same(out, tensor({n * (n + 1) / 2, 10 * n * (n + 1) / 2, 100 * n * (n + 1) / 2}, at::kDouble)));
    // Integers too.
    auto i = tensor({static_cast<double>(g.rank())}, at::kLong);
    dtensor::all_reduce_(i, ReduceOp::Sum, g);
    CHECK(i.item<int64_t>() == g.size() * (g.size() - 1) / 2);
  }
}

TEST_CASE("all_gather along dim 0 and dim 1", "[collectives][world1][world2][world4]") {
  for (const auto& g : groups_under_test()) {
    INFO(g.to_string());
    // Group rank k holds a 2x3 block filled with k*100 + i*3 + j.
    auto block = [&](int k) {
      return (at::arange(6, options()).view({2, 3}) + 100.0 * k);
    };
    auto local = block(g.rank());
    std::vector<at::Tensor> blocks;
    for (int k = 0; k < g.size(); ++k) {
      blocks.push_back(block(k));
    }
    CHECK(same(dtensor::all_gather_tensor(local, 0, g), at::cat(blocks, 0)));
    CHECK(same(dtensor::all_gather_tensor(local, 1, g), at::cat(blocks, 1)));
    CHECK(same(dtensor::all_gather_tensor(local, -1, g), at::cat(blocks, 1)));
    at::Tensor out = at::empty({2 * g.size(), 3}, options());
    dtensor::all_gather_into_tensor(out, local, g);
    CHECK(same(out, at::cat(blocks, 0)));
  }
}

TEST_CASE("reduce_scatter along dim 0 and dim 1", "[collectives][world1][world2][world4]") {
  for (const auto& g : groups_under_test()) {
    INFO(g.to_string());
    int64_t n = g.size();
    // Every rank holds x * (rank + 1) with x = arange; the sum is x * n(n+1)/2.
    auto x0 = at::arange(2 * n * 3, options()).view({2 * n, 3});
    auto x1 = at::arange(3 * 2 * n, options()).view({3, 2 * n});
    double s = static_cast<double>(n * (n + 1) / 2);
    auto r0 = dtensor::reduce_scatter_tensor(x0 * (g.rank() + 1), ReduceOp::Sum, 0, g);
    CHECK(same(r0, x0.chunk(n, 0)[g.rank()] * s));
    auto r1 = dtensor::reduce_scatter_tensor(x1 * (g.rank() + 1), ReduceOp::Sum, 1, g);
    CHECK(same(r1, (x1.chunk(n, 1)[g.rank()] * s).contiguous()));
    auto ra = dtensor::reduce_scatter_tensor(x0 * (g.rank() + 1), ReduceOp::Avg, 0, g);
    CHECK(at::allclose(ra.cpu(), (x0.chunk(n, 0)[g.rank()] * (s / n)).cpu()));
    auto rm = dtensor::reduce_scatter_tensor(x0 * (g.rank() + 1), ReduceOp::Max, 0, g);
    CHECK(same(rm, x0.chunk(n, 0)[g.rank()] * static_cast<double>(n)));
  }
}

// Every rank can build every rank's input, so each rank computes the reduced shard itself,
// adding the ranks' chunks in rank order: [Note: Gloo's reduce-scatter as an all-to-all] in
// lib/mesh/gloo_fast_paths.cpp promises that order, so on Gloo the float sums match exactly.
TEST_CASE("reduce_scatter in every dtype, asynchronous, its input dropped by the caller",
          "[collectives][world1][world2][world4]") {
  for (const auto& g : groups_under_test()) {
    INFO(g.to_string());
    const int64_t n = g.size();
    const bool gloo = g.backend_type() == dtensor::BackendType::Gloo;
    for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kInt, at::kLong,
                       at::kComplexFloat}) {
      const bool floating = at::isFloatingType(dtype) || at::isComplexType(dtype);
      for (auto op : {ReduceOp::Sum, ReduceOp::Avg}) {
        if (op == ReduceOp::Avg && !floating) {
          continue; // refused for integers: the errors case below
        }
        INFO(c10::toString(dtype) << " " << dtensor::to_string(op));
        auto input_of = [&](int64_t r) {
          at::Tensor t = at::randn({2 * n, 5}, at::TensorOptions().dtype(at::kDouble)
                                                   .device(device_type()))
                             .mul_(1000.0 + r);
          if (at::isComplexType(dtype)) {
            return at::complex(t, t.flip(0)).to(dtype);
          }
          return t.to(dtype);
        };
        at::manual_seed(41);
        std::vector<at::Tensor> inputs;
        for (int64_t r = 0; r < n; ++r) {
          inputs.push_back(input_of(r));
        }
        const auto wide = at::isComplexType(dtype) ? at::kComplexDouble : at::kDouble;
        at::Tensor expect = inputs[0].chunk(n)[g.rank()].clone();
        at::Tensor exact = expect.to(wide, /*non_blocking=*/false, /*copy=*/true);
        at::Tensor magnitude = exact.abs();
        for (int64_t r = 1; r < n; ++r) {
          expect.add_(inputs[r].chunk(n)[g.rank()]);
          exact.add_(inputs[r].chunk(n)[g.rank()].to(wide));
          magnitude.add_(inputs[r].chunk(n)[g.rank()].to(wide).abs());
        }
        if (op == ReduceOp::Avg) {
          expect.div_(n);
          exact.div_(n);
          magnitude.div_(n);
        }
        at::Tensor mine = inputs[g.rank()];
        inputs.clear();
        at::Tensor shard = at::empty({2, 5}, mine.options());
        auto work = dtensor::reduce_scatter_tensor_into(
            shard, mine, op, g, dtensor::CollectiveOptions().async_op(true));
        mine.reset(); // the caller's reference goes; the collective keeps what it reads
        work.wait();
        REQUIRE(shard.scalar_type() == dtype);
        if (gloo && dtype != at::kBFloat16) {
          CHECK(same(shard, expect));
        } else { // NCCL's order; bf16 rounds partial sums: within a few of its 2^-8 steps
          const double eps = dtype == at::kBFloat16 ? 1.0 / 64 : 1e-5;
          CHECK(((shard.cpu().to(wide) - exact.cpu()).abs() <= magnitude.cpu() * eps).all()
                    .item<bool>());
        }
      }
    }
  }
}

TEST_CASE("all_gather in every dtype, asynchronous, its input dropped by the caller",
          "[collectives][world1][world2][world4]") {
  // On two Gloo ranks an exchange of the peer's rows ([Note: two Gloo ranks by split sizes]
  // in lib/mesh/collectives.cpp), elsewhere Gloo's or NCCL's all-gather: a copy either way,
  // so every dtype comes back bit for bit.
  for (const auto& g : groups_under_test()) {
    INFO(g.to_string());
    const int64_t n = g.size();
    for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kInt, at::kLong, at::kBool,
                       at::kComplexFloat}) {
      INFO(c10::toString(dtype));
      auto block_of = [&](int64_t r) {
        at::Tensor t = at::arange(15, at::TensorOptions().dtype(at::kDouble)
                                          .device(device_type()))
                           .view({3, 5})
                           .mul_(r + 1)
                           .add_(0.25 * static_cast<double>(r));
        if (dtype == at::kBool) {
          return t.fmod(2.0 + static_cast<double>(r)).lt(1.0);
        }
        if (at::isComplexType(dtype)) {
          return at::complex(t, t.neg()).to(dtype);
        }
        return t.to(dtype);
      };
      std::vector<at::Tensor> blocks;
      for (int64_t r = 0; r < n; ++r) {
        blocks.push_back(block_of(r));
      }
      at::Tensor mine = blocks[static_cast<size_t>(g.rank())].clone();
      at::Tensor gathered = at::empty({3 * n, 5}, mine.options());
      auto work = dtensor::all_gather_into_tensor(gathered, mine, g,
                                                  dtensor::CollectiveOptions().async_op(true));
      mine.reset(); // the caller's reference goes; the collective keeps what it reads
      work.wait();
      REQUIRE(gathered.scalar_type() == dtype);
      CHECK(same(gathered, at::cat(blocks, 0)));
    }
  }
}

namespace {

// Runs `check(group)` on every group under test of two ranks or more while host memory is
// counted; on CPU ranks only (the counter sees host allocations).
template <typename Check>
void on_groups_counting_host_memory(Check&& check) {
  if (device_type() != at::kCPU) {
    WARN("host memory is counted on CPU ranks only: not checked on " << device_type());
    return;
  }
  dtensor::count_host_memory();
  for (const auto& g : groups_under_test()) {
    if (g.size() < 2) {
      continue; // nothing moves
    }
    INFO(g.to_string());
    check(g);
  }
}

// The host bytes allocated beyond those alive before while `in_flight` runs.
template <typename F>
int64_t extra_host_bytes(F&& in_flight) {
  dtensor::reset_peak_host_memory();
  const int64_t before = dtensor::host_memory_stats().live_bytes;
  in_flight();
  return dtensor::host_memory_stats().max_live_bytes - before;
}

} // namespace

// Guards [Note: Gloo's all-gather by point-to-point] (and the two-rank exchange): an
// all-gather receives straight into the caller's output, where ProcessGroupGloo's own holds a
// flat temporary of the whole output while in flight; two in flight on one group at once
// keep apart (each its own tags).
TEST_CASE("all_gather on CPU ranks holds no temporary of the output's size; two in flight",
          "[collectives][world2][world4]") {
  on_groups_counting_host_memory([](const dtensor::Group& g) {
    const int64_t n = g.size();
    const int64_t rows = 4096; // 1 MiB of fp32 per rank
    at::Tensor a = at::full({rows, 64}, static_cast<double>(g.rank() + 1), options());
    at::Tensor b = a * 10;
    at::Tensor out_a = at::empty({rows * n, 64}, options()), out_b = at::empty_like(out_a);
    const int64_t extra = extra_host_bytes([&] {
      const auto async = dtensor::CollectiveOptions().async_op(true);
      auto wa = dtensor::all_gather_into_tensor(out_a, a, g, async);
      auto wb = dtensor::all_gather_into_tensor(out_b, b, g, async);
      wb.wait();
      wa.wait();
    });
    INFO("bytes allocated beyond the outputs while in flight: " << extra);
    CHECK(extra < static_cast<int64_t>(out_a.nbytes()) / 8);
    std::vector<at::Tensor> want_a, want_b;
    for (int64_t r = 0; r < n; ++r) {
      want_a.push_back(at::full({rows, 64}, static_cast<double>(r + 1), options()));
      want_b.push_back(want_a.back() * 10);
    }
    CHECK(same(out_a, at::cat(want_a)));
    CHECK(same(out_b, at::cat(want_b)));
  });
}

// Guards [Note: Gloo's reduce-scatter as an all-to-all] (and the two-rank exchange): the
// chunks go from the caller's input, the first peer's lands in the output, and only the other
// n - 2 peers' chunks take a buffer, where gloo::alltoall received the whole input's size; two
// in flight on one group at once keep apart (each its own tags) and sum in rank order.
TEST_CASE("reduce_scatter on CPU ranks buffers n - 2 chunks; two in flight",
          "[collectives][world2][world4]") {
  on_groups_counting_host_memory([](const dtensor::Group& g) {
    const int64_t n = g.size();
    const int64_t rows = 4096; // 1 MiB of fp32 per output chunk
    auto input_of = [&](int64_t r) {
      return at::arange(rows * n * 64, options())
          .remainder(1000)
          .add_(1)
          .mul_(r + 1)
          .view({rows * n, 64});
    };
    at::Tensor a = input_of(g.rank()), b = a * 10;
    at::Tensor out_a = at::empty({rows, 64}, options()), out_b = at::empty_like(out_a);
    const int64_t extra = extra_host_bytes([&] {
      const auto async = dtensor::CollectiveOptions().async_op(true);
      auto wa = dtensor::reduce_scatter_tensor_into(out_a, a, ReduceOp::Sum, g, async);
      auto wb = dtensor::reduce_scatter_tensor_into(out_b, b, ReduceOp::Sum, g, async);
      wb.wait();
      wa.wait();
    });
    const int64_t chunk = static_cast<int64_t>(out_a.nbytes());
    INFO("bytes allocated beyond the outputs while in flight: " << extra);
    CHECK(extra < 2 * (n - 2) * chunk + chunk / 8);
    at::Tensor want = input_of(0).chunk(n)[g.rank()].clone();
    for (int64_t r = 1; r < n; ++r) {
      want.add_(input_of(r).chunk(n)[g.rank()]);
    }
    CHECK(same(out_a, want));
    CHECK(same(out_b, want * 10));
  });
}

TEST_CASE("all_to_all_single with equal and uneven splits", "[collectives][world1][world2][world4]") {
  for (const auto& g : groups_under_test()) {
    INFO(g.to_string());
    int n = g.size();
    int me = g.rank();
    // Equal splits: rank i sends row block j (value 10*i + j) to rank j.
    std::vector<double> send;
    for (int j = 0; j < n; ++j) {
      send.push_back(10.0 * me + j);
    }
    auto out = dtensor::all_to_all_single(tensor(send).view({n, 1}), {}, {}, g);
    std::vector<double> expect;
    for (int i = 0; i < n; ++i) {
      expect.push_back(10.0 * i + me);
    }
    CHECK(same(out, tensor(expect).view({n, 1})));
    // Uneven: rank i sends (j + 1) rows of value 10*i + j to rank j.
    std::vector<double> rows;
    std::vector<int64_t> in_splits;
    for (int j = 0; j < n; ++j) {
      in_splits.push_back(j + 1);
      for (int k = 0; k <= j; ++k) {
        rows.push_back(10.0 * me + j);
      }
    }
    std::vector<int64_t> out_splits(static_cast<size_t>(n), me + 1);
    auto uneven = dtensor::all_to_all_single(tensor(rows), out_splits, in_splits, g);
    std::vector<double> got_expect;
    for (int i = 0; i < n; ++i) {
      for (int k = 0; k <= me; ++k) {
        got_expect.push_back(10.0 * i + me);
      }
    }
    CHECK(same(uneven, tensor(got_expect)));
  }
}

TEST_CASE("broadcast and barrier", "[collectives][world1][world2][world4]") {
  for (const auto& g : groups_under_test()) {
    INFO(g.to_string());
    for (int src = 0; src < g.size(); ++src) {
      auto t = tensor({static_cast<double>(g.ranks()[static_cast<size_t>(g.rank())]), 7});
      dtensor::broadcast_(t, src, g);
      CHECK(same(t, tensor({static_cast<double>(g.ranks()[static_cast<size_t>(src)]), 7})));
    }
    dtensor::barrier(g);
  }
}

// Point-to-point (pipeline stages): each group rank sends to the next and receives from the
// previous, twice in flight with different tags, every dtype a stage may send; CommDebugMode
// counts one send and one receive per transfer with their bytes; a peer outside the group or
// the rank itself is refused naming it.
TEST_CASE("send and recv around a ring", "[collectives][world1][world2][world4]") {
  for (const auto& g : groups_under_test()) {
    INFO(g.to_string());
    int n = g.size();
    if (n == 1) {
      auto t = at::ones({2}, options());
      REQUIRE_THROWS_WITH(dtensor::send(t, 0, g), contains("send: peer group rank 0 is not another rank of group"));
      REQUIRE_THROWS_WITH(dtensor::recv(t, 1, g), contains("recv: peer group rank 1 is not another rank"));
      continue;
    }
    int next = (g.rank() + 1) % n, prev = (g.rank() + n - 1) % n;
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
      INFO(c10::toString(dtype));
      auto opts = dtensor::CollectiveOptions().async_op(true);
      auto a = contribution(g, dtype);
      auto b = at::arange(4, options(dtype)).add(g.rank());
      at::Tensor got_a = at::empty({3}, options(dtype));
      at::Tensor got_b = at::empty({4}, options(dtype));
      dtensor::CommDebugMode mode;
      std::vector<dtensor::Work> works;
      // Even ranks send first, odd ranks receive first: Gloo pairs them either way.
      if (g.rank() % 2 == 0) {
        works.push_back(dtensor::send(a, next, g, 1, opts));
        works.push_back(dtensor::send(b, next, g, 2, opts));
        works.push_back(dtensor::recv(got_b, prev, g, 2, opts));
        works.push_back(dtensor::recv(got_a, prev, g, 1, opts));
      } else {
        works.push_back(dtensor::recv(got_b, prev, g, 2, opts));
        works.push_back(dtensor::recv(got_a, prev, g, 1, opts));
        works.push_back(dtensor::send(a, next, g, 1, opts));
        works.push_back(dtensor::send(b, next, g, 2, opts));
      }
      for (auto& w : works) {
        w.wait();
      }
      double v = prev + 1;
      CHECK(same(got_a, tensor({v, 10 * v, 100 * v}, dtype)));
      CHECK(same(got_b, at::arange(4, options(dtype)).add(prev)));
      CHECK(mode.count(dtensor::CollectiveKind::Send) == 2);
      CHECK(mode.count(dtensor::CollectiveKind::Recv) == 2);
      int64_t elem = c10::elementSize(dtype);
      CHECK(mode.bytes_in(dtensor::CollectiveKind::Send) == 7 * elem);
      CHECK(mode.total_bytes_out() == 7 * elem); // the receives
    }
    auto t = at::ones({2}, options());
    REQUIRE_THROWS_WITH(dtensor::send(t, n, g), contains("send: peer group rank " + std::to_string(n) +
                                                         " is not another rank of group"));
    REQUIRE_THROWS_WITH(dtensor::recv(t, g.rank(), g), contains("(this rank is " + std::to_string(g.rank()) + ")"));
  }
}

TEST_CASE("async collectives complete on wait()", "[collectives][world1][world2][world4]") {
  for (const auto& g : groups_under_test()) {
    INFO(g.to_string());
    double n = g.size();
    auto opts = dtensor::CollectiveOptions().async_op(true);
    auto a = contribution(g);
    auto b = contribution(g);
    auto w1 = dtensor::all_reduce_(a, ReduceOp::Sum, g, opts);
    auto w2 = dtensor::all_reduce_(b, ReduceOp::Avg, g, opts);
    at::Tensor gathered = at::empty({3 * g.size()}, options());
    auto local = contribution(g);
    auto w3 = dtensor::all_gather_into_tensor(gathered, local, g, opts);
    at::Tensor shard = at::empty({1}, options());
    auto full = tensor(std::vector<double>(static_cast<size_t>(g.size()), 2.0));
    auto w4 = dtensor::reduce_scatter_tensor_into(shard, full, ReduceOp::Avg, g, opts);
    w1.wait();
    w2.wait();
    w3.wait();
    w4.wait();
    CHECK(w1.completed());
    CHECK(same(a, scaled(n * (n + 1) / 2)));
    CHECK(at::allclose(b.cpu(), scaled((n + 1) / 2).cpu()));
    std::vector<double> expect;
    for (int k = 1; k <= g.size(); ++k) {
      expect.insert(expect.end(), {1.0 * k, 10.0 * k, 100.0 * k});
    }
    CHECK(same(gathered, tensor(expect)));
    CHECK(shard.item<float>() == 2.0f); // average of 2s, emulated on Gloo
  }
}

TEST_CASE("collective errors name the op, the shapes and the group", "[collectives][world1][world2][world4]") {
  auto g = init_device_mesh(device_type(), {world()}, {"w"}).get_group();
  int n = g.size();
  auto x = at::ones({3, 4}, options());
  at::Tensor bad_out = at::empty({n * 3 + 1, 4}, options());
  REQUIRE_THROWS_WITH(dtensor::all_gather_into_tensor(bad_out, x, g),
                      contains("all_gather_into_tensor: output Float[" + std::to_string(n * 3 + 1) +
                               ", 4]"));
  REQUIRE_THROWS_WITH(dtensor::all_gather_into_tensor(bad_out, x, g), contains("does not fit input Float[3, 4]"));
  at::Tensor small = at::empty({1, 4}, options());
  REQUIRE_THROWS_WITH(dtensor::reduce_scatter_tensor_into(small, x, ReduceOp::Sum, g),
                      contains("reduce_scatter_tensor: input Float[3, 4]"));
  if (n > 1) {
    REQUIRE_THROWS_WITH(dtensor::reduce_scatter_tensor(at::ones({3, 4}, options()), ReduceOp::Sum, 0, g),
                        contains("dim 0 of Float[3, 4]"));
  }
  REQUIRE_THROWS_WITH(dtensor::all_gather_tensor(x, 2, g), contains("dim 2 is out of range for Float[3, 4]"));
  auto xt = x.t();
  REQUIRE_THROWS_WITH(dtensor::all_reduce_(xt, ReduceOp::Sum, g), contains("must be contiguous"));
  auto ints = at::ones({2}, options(at::kLong));
  REQUIRE_THROWS_WITH(dtensor::all_reduce_(ints, ReduceOp::Avg, g),
                      contains("ReduceOp avg needs a floating-point tensor, got Long[2]"));
  auto int_rows = at::ones({2 * n}, options(at::kLong));
  auto int_shard = at::empty({2}, options(at::kLong));
  REQUIRE_THROWS_WITH(dtensor::reduce_scatter_tensor_into(int_shard, int_rows, ReduceOp::Avg, g),
                      contains("reduce_scatter_tensor: ReduceOp avg needs a floating-point tensor, "
                               "got Long[" + std::to_string(2 * n) + "]"));
  auto meta = at::empty({2}, at::TensorOptions().device(at::kMeta));
  REQUIRE_THROWS_WITH(dtensor::all_reduce_(meta, ReduceOp::Sum, g), contains("is Float[2] on meta but group w"));
  REQUIRE_THROWS_WITH(dtensor::broadcast_(x, n, g), contains("source group rank " + std::to_string(n) + " is out of range"));
  if (n > 1) {
    REQUIRE_THROWS_WITH(dtensor::all_to_all_single(at::ones({n + 1}, options()), {}, {}, g),
                        contains("is not divisible by the " + std::to_string(n) + " ranks"));
  }
  std::vector<int64_t> wrong(static_cast<size_t>(n), 2);
  REQUIRE_THROWS_WITH(dtensor::all_to_all_single(at::ones({2 * n + 1}, options()), {}, wrong, g),
                      contains("add up to " + std::to_string(2 * n)));
}
