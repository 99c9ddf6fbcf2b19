// Reliability: one test per defect of the reliability issue, each judged against the plain
// op on the full tensor (or against the same dtensor::Error on every rank, with no rank
// left waiting in a collective).
#include <torch/nn/modules/linear.h>

#include <dtensor/flight_recorder.h>

#include <cmath>
#include <functional>
#include <regex>

#include "mesh/agree.h"
#include "support/prelude.h"

using dtensor::distribute_tensor;

namespace {

Placement S(int64_t d) { return Placement::shard(d); }
Placement R() { return Placement::replicate(); }
Placement P(ReduceOp op = ReduceOp::Sum) { return Placement::partial(op); }

// A 1-D mesh over the world, and on 4 ranks a 2x2 mesh.
std::vector<dtensor::DeviceMesh> test_meshes() {
  std::vector<dtensor::DeviceMesh> out{init_device_mesh(device_type(), {world()}, {"x"})};
  if (world() == 4) {
    out.push_back(init_device_mesh(device_type(), {2, 2}, {"a", "b"}));
  }
  return out;
}

// Every combination of Replicate and Shard(d) (d < ndim) over the mesh's dimensions.
std::vector<Placements> placement_grid(int64_t mesh_ndim, int64_t ndim) {
  std::vector<Placement> one{R()};
  for (int64_t d = 0; d < ndim; ++d) {
    one.push_back(S(d));
  }
  std::vector<Placements> out{{}};
  for (int64_t i = 0; i < mesh_ndim; ++i) {
    std::vector<Placements> next;
    for (const auto& prefix : out) {
      for (const auto& p : one) {
        auto q = prefix;
        q.push_back(p);
        next.push_back(q);
      }
    }
    out = next;
  }
  return out;
}

} // namespace

TEST_CASE("reliability 1: views and contiguous() keep the global strides of the plain op",
          "[reliability][world1][world2][world4]") {
  at::Tensor x = at::arange(96., options(at::kDouble)).view({2, 4, 4, 3});
  int cases = 0;
  for (const auto& mesh : test_meshes()) {
    for (const auto& pl : placement_grid(mesh.ndim(), 4)) {
      INFO(mesh.to_string() << " " << dtensor::to_string(pl));
      DTensor d = distribute_tensor(x, mesh, pl);
      at::Tensor dt = d.transpose(1, 2);
      at::Tensor pt = x.transpose(1, 2);
      REQUIRE(dt.strides() == pt.strides());
      REQUIRE(dt.is_contiguous() == pt.is_contiguous());
      REQUIRE(same(full_value(dt.contiguous().view({2, 4, 12})), pt.contiguous().view({2, 4, 12})));
      REQUIRE(same(full_value(dt.reshape({2, 4, 12})), pt.reshape({2, 4, 12})));
      REQUIRE(same(full_value(dt.flatten(2)), pt.flatten(2)));
      REQUIRE(same(full_value(dt.contiguous()), pt.contiguous()));
      REQUIRE(dt.contiguous().is_contiguous());
      at::Tensor dp = d.permute({0, 3, 1, 2});
      REQUIRE(dp.strides() == x.permute({0, 3, 1, 2}).strides());
      REQUIRE(same(full_value(dp.reshape({2, 3, 16})), x.permute({0, 3, 1, 2}).reshape({2, 3, 16})));
      REQUIRE(same(full_value(d.view({8, 12})), x.view({8, 12})));
      REQUIRE(same(full_value(d.view({96})), x.view({96})));
      REQUIRE(same(full_value(d.view({2, 2, 2, 12})), x.view({2, 2, 2, 12})));
      REQUIRE(same(full_value(d.flatten(0, 1).view({2, 4, 4, 3})), x));
      ++cases;
    }
  }
  REQUIRE(cases == (world() == 4 ? 5 + 25 : 5));
}

TEST_CASE("reliability 2: broadcast_from_rank0 validates before any data moves, on every rank",
          "[reliability][world1][world2][world4]") {
  torch::manual_seed(0);
  torch::nn::Linear lin(4, 3);
  auto full = dtensor::get_model_state_dict(*lin);
  auto opts = dtensor::StateDictOptions().broadcast_from_rank0(true);
  at::Tensor before = lin->weight.detach().clone();

  // A key missing on rank 0: every rank raises the same error naming it.
  dtensor::StateDict missing;
  if (rank() == 0) {
    missing.insert("weight", full["weight"] * 2);
  }
  REQUIRE_THROWS_WITH(dtensor::set_model_state_dict(*lin, missing, opts),
                      contains("'bias' is missing on rank 0"));
  REQUIRE(same(lin->weight.detach(), before)); // nothing half-written

  // A wrong shape on rank 0.
  dtensor::StateDict wrong;
  if (rank() == 0) {
    wrong.insert("weight", full["weight"] * 2);
    wrong.insert("bias", at::zeros({5}));
  }
  REQUIRE_THROWS_WITH(dtensor::set_model_state_dict(*lin, wrong, opts),
                      contains("'bias' has shape [5] on rank 0 but the module's is [3]"));
  REQUIRE(same(lin->weight.detach(), before));

  // An unknown key on rank 0.
  dtensor::StateDict unknown;
  if (rank() == 0) {
    unknown = full;
    unknown.insert("nope", at::zeros({1}));
  }
  REQUIRE_THROWS_WITH(dtensor::set_model_state_dict(*lin, unknown, opts), contains("'nope'"));

  // Without broadcast, on a fully sharded module (its load redistributes): a wrong shape on
  // the last rank only still fails every rank, and no rank has written anything.
  {
    auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
    torch::manual_seed(0);
    torch::nn::Linear sharded(4, 3);
    sharded->to(options().device());
    dtensor::fully_shard(*sharded, dtensor::FullyShardOptions().mesh(mesh));
    auto sd = dtensor::get_model_state_dict(*sharded,
                                            dtensor::StateDictOptions().full_state_dict(true));
    at::Tensor w = full_value(sharded->weight).clone();
    dtensor::StateDict mine = sd;
    if (rank() == world() - 1) {
      mine = dtensor::StateDict();
      mine.insert("weight", sd["weight"] * 3);
      mine.insert("bias", at::zeros({7}, options()));
    }
    REQUIRE_THROWS_WITH(dtensor::set_model_state_dict(*sharded, mine),
                        contains("rank " + std::to_string(world() - 1) + ": 'bias' has shape [7]"));
    REQUIRE(same(full_value(sharded->weight), w));
    // A plain module loads without communication: the error is raised where it is found.
    dtensor::StateDict bad_plain = full;
    if (rank() == world() - 1) {
      bad_plain = dtensor::StateDict();
      bad_plain.insert("weight", full["weight"]);
    }
    if (rank() == world() - 1) {
      REQUIRE_THROWS_WITH(dtensor::set_model_state_dict(*lin, bad_plain), contains("'bias' is missing"));
    } else {
      REQUIRE_NOTHROW(dtensor::set_model_state_dict(*lin, bad_plain));
    }
  }

  // And the valid dicts still load.
  dtensor::StateDict good;
  if (rank() == 0) {
    good.insert("weight", full["weight"] * 2);
    good.insert("bias", full["bias"] * 2);
  }
  dtensor::set_model_state_dict(*lin, good, opts);
  REQUIRE(same(lin->weight.detach(), before * 2));
}

TEST_CASE("reliability 3: from_local with a given shape checks this rank's local shape",
          "[reliability][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  at::Tensor local = at::full({rank() + 1, 4}, 1.0, options());
  std::vector<int64_t> shape{world(), 4};
  if (rank() == 0) {
    REQUIRE_NOTHROW(DTensor::from_local(local, mesh, {S(0)}, shape));
  } else {
    REQUIRE_THROWS_WITH(DTensor::from_local(local, mesh, {S(0)}, shape),
                        contains("local tensor of shape [" + std::to_string(rank() + 1) + ", 4] on rank " +
                                 std::to_string(rank())));
  }
}

TEST_CASE("reliability 4: complex DTensors gather, scatter and multiply",
          "[reliability][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  at::Tensor re = at::arange(24., options()).view({6, 4});
  at::Tensor x = at::complex(re, -re * 0.5);
  DTensor d = distribute_tensor(x, mesh, {S(0)});
  REQUIRE(same(d.full_tensor(), x));
  REQUIRE(same(d.redistribute({R()}).to_local(), x));
  REQUIRE(same(full_value(d.redistribute({S(1)})), x));
  at::Tensor w = at::complex(at::ones({4, 3}, options()), at::arange(12., options()).view({4, 3}));
  DTensor dw = distribute_tensor(w, mesh, {R()});
  auto close_complex = [](const at::Tensor& a, const at::Tensor& b) {
    return a.is_complex() && b.is_complex() && close(at::view_as_real(a), at::view_as_real(b));
  };
  REQUIRE(close_complex(full_value(at::matmul(d, dw)), at::matmul(x, w)));
  DTensor p = distribute_tensor(x, mesh, {R()}).redistribute({P()});
  REQUIRE(close_complex(p.full_tensor(), x));
  REQUIRE(close_complex(full_value(p.redistribute({S(0)})), x));
  if (mesh.size() > 1) { // one rank reduces nothing ([Note: one-rank mesh dimensions ...])
    REQUIRE_THROWS_WITH(p.redistribute({P(ReduceOp::Max)}).full_tensor(),
                        contains("ReduceOp max is not defined for the complex tensor"));
  }
}

TEST_CASE("reliability 5: ops on zero-element DTensors", "[reliability][world1][world2][world4]") {
  for (const auto& mesh : test_meshes()) {
    for (const auto& pl : placement_grid(mesh.ndim(), 2)) {
      INFO(mesh.to_string() << " " << dtensor::to_string(pl));
      at::Tensor z = at::zeros({0, 4}, options());
      DTensor d = distribute_tensor(z, mesh, pl);
      REQUIRE(same(full_value(d + d), z + z));
      REQUIRE(same(full_value(d.transpose(0, -1).contiguous().view(-1)), z.t().contiguous().view(-1)));
      REQUIRE(same(full_value(d.sum(0)), z.sum(0)));
      REQUIRE(same(full_value(d * 2 + 1), z * 2 + 1));
      at::Tensor z2 = at::zeros({0, 3}, options());
      DTensor d2 = distribute_tensor(z2, mesh, pl);
      REQUIRE(same(full_value(d2.t().contiguous().view({-1})), z2.t().contiguous().view({-1})));
      REQUIRE(same(full_value(d2.reshape({3, 0})), z2.reshape({3, 0})));
    }
  }
}

TEST_CASE("reliability 6a: pointwise ops respect the Partial's reduce op",
          "[reliability][world1][world2][world4]") {
  at::Tensor x = at::linspace(-2, 2, 12, options(at::kDouble)).view({3, 4});
  for (const auto& mesh : test_meshes()) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      Placements pl(static_cast<size_t>(mesh.ndim()), P(op));
      Placements rep(static_cast<size_t>(mesh.ndim()), R());
      INFO(mesh.to_string() << " " << dtensor::to_string(pl));
      DTensor d = distribute_tensor(x, mesh, rep).redistribute(pl);
      REQUIRE(close(d.full_tensor(), x));
      REQUIRE(close(full_value(d.neg().exp()), x.neg().exp()));
      REQUIRE(close(full_value(d.neg()), x.neg()));
      REQUIRE(close(full_value(d.exp()), x.exp()));
      REQUIRE(close(full_value(d * 3), x * 3));
      REQUIRE(close(full_value(d * -3), x * -3));
      REQUIRE(close(full_value(d + 1), x + 1));
      REQUIRE(close(full_value(d / 2), x / 2));
      REQUIRE(close(full_value(d.relu()), x.relu()));
      REQUIRE(close(full_value(d.abs()), x.abs()));
      REQUIRE(close(full_value(d + d), x + x));
      REQUIRE(close(full_value(d * d), x * x));
      DTensor r = distribute_tensor(x, mesh, rep);
      REQUIRE(close(full_value(d + r), x + x));
      REQUIRE(close(full_value(d * r), x * x));
      REQUIRE(close(full_value(d - r), x - x));
      REQUIRE(close(full_value(at::sigmoid(d)), at::sigmoid(x)));
      REQUIRE(close(full_value(d.sum()), x.sum()));
      REQUIRE(close(full_value(d.amax(-1)), x.amax(-1)));
    }
    // neg of a Partial(max) is a Partial(min) (no communication), and back.
    Placements pmax(static_cast<size_t>(mesh.ndim()), P(ReduceOp::Max));
    DTensor m = distribute_tensor(x, mesh, Placements(static_cast<size_t>(mesh.ndim()), R())).redistribute(pmax);
    CommDebugMode mode;
    DTensor n(m.neg());
    REQUIRE(mode.total_count() == 0);
    REQUIRE(n.placements() == Placements(static_cast<size_t>(mesh.ndim()), P(ReduceOp::Min)));
    DTensor e(m.exp());
    REQUIRE(e.placements() == pmax);
    REQUIRE(mode.total_count() == 0);
    REQUIRE(close(n.full_tensor(), x.neg()));
  }
}

TEST_CASE("reliability 6b: redistributions with uneven and empty shards do not deadlock",
          "[reliability][world1][world2][world4]") {
  auto mesh1 = init_device_mesh(device_type(), {world()}, {"x"});
  at::Tensor a = at::arange(36., options(at::kDouble)).view({6, 6});
  DTensor d = distribute_tensor(a, mesh1, {S(0)});
  DTensor moved = d.redistribute({S(1)});
  REQUIRE(same(moved.full_tensor(), a));
  REQUIRE(same(moved.to_local(), a.chunk(world(), 1).size() > static_cast<size_t>(rank())
                                     ? a.chunk(world(), 1)[static_cast<size_t>(rank())]
                                     : at::zeros({6, 0}, options(at::kDouble))));
  if (world() == 4) {
    auto mesh = init_device_mesh(device_type(), {2, 2}, {"a", "b"});
    at::Tensor b = at::arange(1., 4., options(at::kDouble)).view({3, 1});
    DTensor src = distribute_tensor(b, mesh, {R(), R()}).redistribute({P(), P(ReduceOp::Max)});
    REQUIRE(same(src.full_tensor(), b));
    REQUIRE(same(src.redistribute({R(), S(1)}).full_tensor(), b));
    at::Tensor c = at::arange(1., 3., options(at::kDouble)).view({2, 1});
    DTensor src2 = distribute_tensor(c, mesh, {R(), R()}).redistribute({R(), P(ReduceOp::Avg)});
    REQUIRE(same(src2.redistribute({R(), S(1)}).full_tensor(), c));
  }
}

TEST_CASE("reliability 6c: reductions over empty shards give the plain result on every rank",
          "[reliability][world1][world2][world4]") {
  for (const auto& mesh : test_meshes()) {
    at::Tensor x = at::arange(6., options()).view({2, 3}) - 2;
    Placements pl(static_cast<size_t>(mesh.ndim()), S(1));
    INFO(mesh.to_string());
    DTensor d = distribute_tensor(x, mesh, pl);
    REQUIRE(same(full_value(d.amax(-1)), x.amax(-1)));
    REQUIRE(same(full_value(d.amin(-1)), x.amin(-1)));
    REQUIRE(same(full_value(d.sum(-1)), x.sum(-1)));
    REQUIRE(same(full_value(std::get<0>(d.max(-1))), std::get<0>(x.max(-1))));
  }
}

TEST_CASE("reliability 7: clip_grad_norm_ norm 0, norm partial orders, error types",
          "[reliability][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  // Three gradients: one all zero, one with a single non-zero on the last rank's shard,
  // one replicated with non-zeros. PyTorch: the number of gradients with a non-zero.
  std::vector<at::Tensor> params;
  at::Tensor g0 = at::zeros({8}, options());
  at::Tensor g1 = at::zeros({8}, options());
  g1[7] = 5;
  at::Tensor g2 = at::arange(4., options());
  for (auto [g, pl] : std::vector<std::pair<at::Tensor, Placements>>{
           {g0, {S(0)}}, {g1, {S(0)}}, {g2, {R()}}}) {
    at::Tensor p = distribute_tensor(at::zeros_like(g), mesh, pl);
    p.mutable_grad() = distribute_tensor(g, mesh, pl);
    params.push_back(p);
  }
  at::Tensor total = dtensor::clip_grad_norm_(params, 1.0, 0.0);
  at::Tensor expected =
      at::linalg_vector_norm(at::stack({at::linalg_vector_norm(g0, 0), at::linalg_vector_norm(g1, 0),
                                        at::linalg_vector_norm(g2, 0)}),
                             0);
  REQUIRE(same(full_value(total), expected));

  REQUIRE_THROWS_WITH(Placement::partial_norm(-1), contains("p must be > 0, 0, inf or -inf"));
  REQUIRE_NOTHROW(Placement::partial_norm(0));
  REQUIRE_NOTHROW(Placement::partial_norm(-INFINITY));
  // Errors from the local kernel come out as dtensor::Error naming the op.
  DTensor a = distribute_tensor(at::ones({4, 3}, options()), mesh, {R()});
  DTensor b = distribute_tensor(at::ones({4, 3}, options()), mesh, {R()});
  REQUIRE_THROWS_AS(at::mm(a, b), dtensor::Error);
  REQUIRE_THROWS_WITH(at::mm(a, b), contains("aten::mm"));
  REQUIRE_THROWS_AS(a.view({5, 5}), dtensor::Error);
}

// Run by the detail-w2 / detail-w4 tests with TORCH_DISTRIBUTED_DEBUG=DETAIL (not by the
// [worldN] runs): shapes that differ between ranks are a clear error on every rank.
TEST_CASE("reliability 3 (TORCH_DISTRIBUTED_DEBUG=DETAIL): mismatched collectives fail on every rank",
          "[detail]") {
  const char* level = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  REQUIRE(level != nullptr);
  REQUIRE(std::string(level) == "DETAIL");
  REQUIRE(world() > 1);
  auto mesh = init_device_mesh(device_type(), {world()}, {"x"});
  // Every rank wraps a different local shape under a global shape of its own (a shape given,
  // so from_local trusts it): full_tensor's all-gather would mix them.
  DTensor d = DTensor::from_local(at::full({rank() + 1, 4}, 1.0, options()), mesh, {S(0)},
                                  std::vector<int64_t>{(rank() + 1) * world(), 4});
  REQUIRE_THROWS_AS(d.full_tensor(), dtensor::Error);
  REQUIRE_THROWS_WITH(d.full_tensor(), contains("all_gather"));
  // distribute_tensor with a different shape per rank.
  REQUIRE_THROWS_WITH(distribute_tensor(at::ones({2 + rank(), 3}, options()), mesh, {R()}),
                      contains("broadcast"));
  // A reduce-scatter of another size on each rank (under DETAIL Gloo's own reduce-scatter,
  // whose shapes the wrapper compares: [Note: Gloo's reduce-scatter as an all-to-all]).
  at::Tensor rs_in = at::ones({2 * world() * (rank() + 1)}, options());
  at::Tensor rs_out = at::empty({2 * (rank() + 1)}, options());
  REQUIRE_THROWS_WITH(
      dtensor::reduce_scatter_tensor_into(rs_out, rs_in, ReduceOp::Sum, mesh.get_group()),
      contains("reduce_scatter"));
  // The groups are still usable afterwards.
  DTensor ok = distribute_tensor(at::arange(8., options()), mesh, {S(0)});
  REQUIRE(same(ok.full_tensor(), at::arange(8., options())));
}

// [Note: agreeing on sizes] (lib/mesh/size_check.cpp): sizes that come from the user and
// differ between ranks, without TORCH_DISTRIBUTED_DEBUG. Unchecked, Gloo's transport thread
// aborts rank 0 and, on two ranks, rank 1 returns a tensor of the wrong size. Checked:
// the same dtensor::Error on every rank (compared by gathering the messages), nothing sent,
// the groups usable afterwards, and the check costs no collective CommDebugMode counts.
namespace {

// Runs `call`, which must throw; returns the message after checking it is the same on every
// rank of the world and contains every piece of `want`.
std::string same_error_everywhere(const std::function<void()>& call,
                                  const std::vector<std::string>& want) {
  std::string message;
  try {
    call();
  } catch (const dtensor::Error& e) {
    message = e.what();
  }
  for (const std::string& w : want) {
    INFO(message);
    REQUIRE(message.find(w) != std::string::npos);
  }
  for (const std::string& other : dtensor::detail::all_gather_strings(message, dtensor::world_group())) {
    REQUIRE(other == message);
  }
  return message;
}

} // namespace

TEST_CASE("reliability 8: local sizes that differ between ranks are one error on every rank",
          "[reliability][world2][world4]") {
  // A CPU mesh: Gloo, also in an NCCL world (the agreement is Gloo's; on NCCL, DETAIL checks).
  auto mesh = init_device_mesh(c10::kCPU, {world()}, {"x"});
  const auto g = mesh.get_group();
  const int64_t n = world();
  const auto cpu = at::TensorOptions();
  // from_local without a shape, then full_tensor: refused at from_local.
  same_error_everywhere(
      [&] { DTensor::from_local(at::ones({rank() == 0 ? 1 : 2, 3}, cpu), mesh, {S(0)}); },
      {"DTensor::from_local((Shard(0)) on DeviceMesh", "disagree, so nothing was sent",
       "rank 0: local [1, 3] Float (global [" + std::to_string(n) + ", 3])",
       "rank 1: local [2, 3] Float (global [" + std::to_string(2 * n) + ", 3])"});
  // Replicate: the shapes themselves must agree.
  same_error_everywhere(
      [&] { DTensor::from_local(at::ones({3 + rank()}, cpu), mesh, {R()}); },
      {"rank 1: local [4] Float (global [4])"});
  if (n == 4) { // a 2x2 mesh, one rank off: every rank learns it over both dimensions
    auto m2 = init_device_mesh(c10::kCPU, {2, 2}, {"a", "b"});
    same_error_everywhere(
        [&] { DTensor::from_local(at::ones({2, rank() == 3 ? 3 : 2}, cpu), m2, {S(0), S(1)}); },
        {"rank 3: local [2, 3] Float (global [4, 6])", "rank 0: local [2, 2] Float (global [4, 4])"});
  }
  // The public collectives, sizes from the caller.
  at::Tensor in = at::ones({rank() + 1, 2}, cpu);
  at::Tensor out = at::empty({(rank() + 1) * n, 2}, cpu);
  same_error_everywhere([&] { dtensor::all_gather_into_tensor(out, in, g); },
                        {"collective: the ranks of group", "rank 1: all_gather_into_tensor(Float[2, 2] on cpu) into Float[" + std::to_string(2 * n) + ", 2] on cpu"});
  same_error_everywhere([&] { dtensor::all_gather_tensor(in, 1, g); }, {"all_gather_tensor"});
  same_error_everywhere([&] { dtensor::all_reduce_(in, ReduceOp::Sum, g); },
                        {"rank 0: all_reduce(sum, Float[1, 2] on cpu)"});
  same_error_everywhere([&] { dtensor::all_reduce(in, ReduceOp::Sum, g); }, {"all_reduce"});
  at::Tensor rs_out = at::empty({rank() + 1, 2}, cpu);
  same_error_everywhere(
      [&] { dtensor::reduce_scatter_tensor_into(rs_out, out, ReduceOp::Sum, g); },
      {"reduce_scatter_tensor"});
  same_error_everywhere([&] { dtensor::broadcast_(in, 0, g); }, {"broadcast(src=0, Float[1, 2] on cpu)"});
  // Ranks calling different collectives.
  same_error_everywhere(
      [&] {
        at::Tensor t = at::ones({2}, cpu);
        if (rank() == 0) {
          dtensor::broadcast_(t, 0, g);
        } else {
          dtensor::all_reduce_(t, ReduceOp::Sum, g);
        }
      },
      {"rank 0: broadcast(src=0, Float[2] on cpu)", "rank 1: all_reduce(sum, Float[2] on cpu)"});
  // all_to_all_single: rank 0 sends 2 rows to rank 1, which expects 1.
  std::vector<int64_t> send(static_cast<size_t>(n), 1), receive(static_cast<size_t>(n), 1);
  if (rank() == 0) {
    send = std::vector<int64_t>(static_cast<size_t>(n), 1);
    send[0] = 0;
    send[1] = 2;
  }
  const at::Tensor a2a = at::ones({n, 2}, cpu);
  same_error_everywhere([&] { dtensor::all_to_all_single(a2a, receive, send, g); },
                        {"rank 0: all_to_all_single(Float[" + std::to_string(n) + ", 2] on cpu) sending 0/2"});

  // Afterwards the groups work, and the agreement is not a counted collective.
  {
    CommDebugMode mode;
    DTensor ok = DTensor::from_local(at::full({2, 3}, double(rank()), cpu), mesh, {S(0)});
    at::Tensor full = ok.full_tensor();
    REQUIRE(same(full, at::arange(n, at::kFloat).repeat_interleave(2).unsqueeze(1).expand({2 * n, 3})));
    at::Tensor gathered = at::empty({2 * n, 2}, cpu);
    dtensor::all_gather_into_tensor(gathered, at::ones({2, 2}, cpu), g);
    REQUIRE(same(gathered, at::ones({2 * n, 2}, cpu)));
    REQUIRE(mode.total_count() == 2); // full_tensor's all-gather and the explicit one
  }
}

// One entry per collective (include/dtensor/collectives.h): CollectiveOptions::agree_sizes
// (false), as the library's own calls pass it, issues the collective alone, where the default
// first issues the agreement's all-gather (the flight recorder's last ids show both); the
// functional forms refuse async_op by name.
TEST_CASE("reliability 8: agree_sizes(false) issues the collective without the agreement",
          "[reliability][world2]") {
  const auto g = dtensor::world_group();
  auto last_id = [] {
    const std::string json = dtensor::flight_record_json();
    int64_t last = -1;
    static const std::regex id("\"id\": *([0-9]+)");
    for (auto it = std::sregex_iterator(json.begin(), json.end(), id); it != std::sregex_iterator();
         ++it) {
      last = std::max<int64_t>(last, std::stoll((*it)[1].str()));
    }
    return last;
  };
  at::Tensor t = at::ones({3});
  int64_t before = last_id();
  dtensor::all_reduce_(t, ReduceOp::Sum, g);
  CHECK(last_id() - before == 2);
  before = last_id();
  dtensor::all_reduce_(t, ReduceOp::Sum, g, dtensor::CollectiveOptions().agree_sizes(false));
  CHECK(last_id() - before == 1);
  CHECK(same(t, at::full({3}, 2.0 * world())));
  before = last_id();
  const at::Tensor gathered =
      dtensor::all_gather_tensor(t, 0, g, dtensor::CollectiveOptions().agree_sizes(false));
  CHECK(last_id() - before == 1);
  CHECK(gathered.size(0) == 3 * world());
  CHECK_THROWS_WITH(
      dtensor::all_reduce(t, ReduceOp::Sum, g, dtensor::CollectiveOptions().async_op(true)),
      contains("all_reduce: the functional form waits for its result"));
}

// Run by agree-off-w2 with DTENSOR_AGREE_SIZES=0 (not by the [worldN] runs): the agreement on
// sizes is off, as in PyTorch: from_local takes each rank's local tensor on trust, so each rank
// holds its own guess of the global shape (and no exchange took place: ranks that differ would
// otherwise raise here).
TEST_CASE("reliability 8 (DTENSOR_AGREE_SIZES=0): from_local trusts each rank", "[agree_off]") {
  const char* v = std::getenv("DTENSOR_AGREE_SIZES");
  REQUIRE((v != nullptr && std::string(v) == "0"));
  auto mesh = init_device_mesh(c10::kCPU, {world()}, {"x"});
  DTensor d = DTensor::from_local(at::ones({rank() + 1, 3}), mesh, {S(0)});
  REQUIRE(d.sizes().vec() == std::vector<int64_t>{(rank() + 1) * world(), 3});
}
