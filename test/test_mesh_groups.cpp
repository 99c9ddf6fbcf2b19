// Meshes on communicators the program made itself (wrap_group, DeviceMesh::from_group) and
// per-dimension backends (init_device_mesh's backend_override). A framework that owns its
// c10d groups is played here by this file: its own store (a client of torchrun's), its own
// c10d::ProcessGroupGloo objects, created without dtensor.
#include <cstdlib>
#include <numeric>
#include <sstream>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "support/prelude.h"

using dtensor::BackendType;
using dtensor::DeviceMeshOptions;
using dtensor::GroupOptions;

namespace {

// The message pieces the tests expect, without fmt (the tests link only dtensor).
template <typename... A>
std::string str(const A&... a) {
  std::ostringstream out;
  (out << ... << a);
  return out.str();
}

// The framework's own rendezvous: torchrun's store under a prefix of its own.
c10::intrusive_ptr<c10d::Store> framework_store() {
  static c10::intrusive_ptr<c10d::Store> store = [] {
    const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (world() == 1 || agent == nullptr || std::string(agent) != "True") {
      REQUIRE(world() == 1); // the tests run under torchrun
      return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::HashStore>());
    }
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(std::stoi(std::getenv("MASTER_PORT")));
    opts.isServer = false;
    opts.waitWorkers = false;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(std::getenv("MASTER_ADDR"), opts);
    return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::PrefixStore>("framework/", tcp));
  }();
  return store;
}

// A Gloo communicator over `ranks` (global), made the way a framework would: its own store
// prefix, its own options. Ranks outside `ranks` get null.
c10::intrusive_ptr<c10d::Backend> framework_group(const std::vector<int>& ranks, const std::string& name) {
  // Every rank calls this in the same order; the count keeps the store keys of groups made
  // again (Catch2 runs a test case once per section) apart from earlier ones.
  static int generation = 0;
  const std::string prefix = str(name, ".", generation++, "/");
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) {
    return {};
  }
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, framework_store());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(it - ranks.begin()),
                                                     static_cast<int>(ranks.size()), options);
}

std::vector<int> iota(int n, int start = 0, int step = 1) {
  std::vector<int> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(start + i * step);
  }
  return out;
}

at::Tensor global_value(int64_t rows, int64_t cols) {
  return at::arange(rows * cols, at::kFloat).reshape({rows, cols});
}

} // namespace

TEST_CASE("a 1-D mesh on the program's own communicator", "[mesh_groups][world1][world2][world4]") {
  const int64_t created = dtensor::num_groups_created();
  auto pg = framework_group(iota(world()), "world");
  auto group = dtensor::wrap_group(pg, iota(world()), "fw");
  REQUIRE(group.size() == world());
  REQUIRE(group.rank() == rank());
  REQUIRE(group.backend_type() == BackendType::Gloo);
  REQUIRE(group.backend().get() == pg.get()); // the program's communicator itself

  auto mesh = DeviceMesh::from_group(group, c10::kCPU, {"x"});
  REQUIRE(mesh.shape() == std::vector<int64_t>{world()});
  REQUIRE(mesh.get_coordinate() == std::vector<int64_t>{rank()});
  REQUIRE(mesh.get_group().backend().get() == pg.get());
  REQUIRE(mesh.get_group().label() == "x");

  const auto full = global_value(4 * world(), 3);
  auto d = dtensor::distribute_tensor(full, mesh, {Placement::shard(0)});
  CommDebugMode mode;
  auto r = d.redistribute(mesh, {Placement::replicate()});
  REQUIRE(same(r.to_local(), full));
  REQUIRE(mode.count("x", CollectiveKind::AllGather) == over(world(), 1));
  REQUIRE(mode.total_count() == over(world(), 1));
  REQUIRE(dtensor::num_groups_created() == created); // dtensor made no communicator
}

TEST_CASE("a 2-D mesh on one communicator per dimension", "[mesh_groups][world2][world4]") {
  const int dp = world() == 4 ? 2 : 1, tp = world() / dp;
  const int row = rank() / tp, col = rank() % tp;
  // Every rank creates the groups it belongs to: its row (tp) and its column (dp). Groups of
  // other rows are created by their members only (rendezvous under distinct prefixes).
  auto tp_pg = framework_group(iota(tp, row * tp), str("tp", row));
  auto dp_pg = framework_group(iota(dp, col, tp), str("dp", col));
  auto tp_group = dtensor::wrap_group(tp_pg, iota(tp, row * tp), "tp");
  auto dp_group = dtensor::wrap_group(dp_pg, iota(dp, col, tp), "dp");
  const int64_t created = dtensor::num_groups_created();
  auto mesh = DeviceMesh::from_group(std::vector<dtensor::Group>{dp_group, tp_group}, c10::kCPU, {dp, tp}, iota(world()),
                                     {"dp", "tp"});
  REQUIRE(mesh.get_coordinate() == std::vector<int64_t>{row, col});
  REQUIRE(mesh["tp"].get_group().backend().get() == tp_pg.get());
  REQUIRE(mesh["dp"].get_group().backend().get() == dp_pg.get());
  REQUIRE(mesh["tp"].ranks() == iota(tp, row * tp));

  SECTION("values and counts on each dimension") {
    const auto full = global_value(2 * dp * 3, 2 * tp);
    auto d = dtensor::distribute_tensor(full, mesh, {Placement::shard(0), Placement::shard(1)});
    CommDebugMode mode;
    auto r = d.redistribute(mesh, {Placement::replicate(), Placement::replicate()});
    REQUIRE(same(r.to_local(), full));
    REQUIRE(mode.count("dp", CollectiveKind::AllGather) == over(dp, 1));
    REQUIRE(mode.count("tp", CollectiveKind::AllGather) == over(tp, 1));
    // A reduction over both dimensions: Partial on each, one all-reduce per dimension.
    auto s = d.sum();
    mode.reset();
    auto total = DTensor(s).full_tensor();
    REQUIRE(close(total, full.sum()));
    REQUIRE(mode.count("dp", CollectiveKind::AllReduce) == over(dp, 1));
    REQUIRE(mode.count("tp", CollectiveKind::AllReduce) == over(tp, 1));
    REQUIRE(dtensor::num_groups_created() == created);
  }

  SECTION("the groups must be this rank's slices, in dimension order") {
    if (dp > 1 && tp > 1) {
      REQUIRE_THROWS_WITH(DeviceMesh::from_group(std::vector<dtensor::Group>{tp_group, dp_group}, c10::kCPU, {dp, tp},
                                                 iota(world()), {"dp", "tp"}),
                          contains(str("dimension 'dp': this rank's slice is ranks [", col, ", ",
                                       col + tp, "] but the group (tp) spans [", row * tp, ", ",
                                       row * tp + 1, "]")));
    }
    REQUIRE_THROWS_WITH(DeviceMesh::from_group(std::vector<dtensor::Group>{dp_group}, c10::kCPU, {dp, tp}, iota(world())),
                        contains("1 groups for 2 dimensions"));
    REQUIRE_THROWS_WITH(DeviceMesh::from_group(std::vector<dtensor::Group>{dp_group, tp_group}, c10::kCPU, {dp, tp},
                                               iota(world() - 1)),
                        contains(str("the shape has ", world(), " ranks, the list ", world() - 1)));
    REQUIRE_THROWS_WITH(DeviceMesh::from_group(std::vector<dtensor::Group>{dp_group, tp_group}, c10::kCUDA, {dp, tp},
                                               iota(world()), {"dp", "tp"}),
                        contains("dimension 'dp': the group's gloo backend serves cpu tensors, not cuda"));
  }

  SECTION("the rank list must match the communicator") {
    std::vector<int> wrong = iota(tp, row * tp);
    std::reverse(wrong.begin(), wrong.end());
    REQUIRE_THROWS_WITH(dtensor::wrap_group(tp_pg, wrong, "tp"),
                        contains(str("this process is global rank ", rank(), " but the backend's rank ",
                                     col, " maps to global rank ", wrong[static_cast<size_t>(col)])));
    REQUIRE_THROWS_WITH(dtensor::wrap_group(tp_pg, {rank()}, "tp"),
                        contains(str("the gloo backend has ", tp, " ranks, the rank list 1")));
    REQUIRE_THROWS_WITH(dtensor::wrap_group({}, iota(world()), "none"), contains("the backend is null"));
  }
}

TEST_CASE("a mesh over some of the ranks", "[mesh_groups][world4]") {
  const std::vector<int> odd{1, 3};
  auto pg = framework_group(odd, "odd");
  if (rank() % 2 == 0) {
    REQUIRE(!pg);
    return;
  }
  auto mesh = DeviceMesh::from_group(dtensor::wrap_group(pg, odd, "odd"), c10::kCPU);
  REQUIRE(mesh.ranks() == odd);
  REQUIRE(mesh.get_coordinate() == std::vector<int64_t>{rank() / 2});
  auto local = at::full({2}, static_cast<float>(rank()));
  auto d = DTensor::from_local(local, mesh, {Placement::partial()});
  CommDebugMode mode;
  REQUIRE(same(d.full_tensor(), at::full({2}, 4.0f)));
  REQUIRE(mode.count("odd", CollectiveKind::AllReduce) == 1);
}

TEST_CASE("per-dimension backends and timeouts", "[mesh_groups][world1][world2][world4]") {
  const int dp = world() == 4 ? 2 : 1, tp = world() / dp;
  const auto world_timeout = dtensor::world_group().timeout();
  auto mesh = init_device_mesh(c10::kCPU, {dp, tp}, {"dp", "tp"},
                               DeviceMeshOptions().backend_override(
                                   {{std::string("tp"), GroupOptions().timeout(std::chrono::seconds(77))},
                                    {int64_t{0}, GroupOptions().backend(BackendType::Gloo)}}));
  REQUIRE(mesh.get_group("tp").timeout() == std::chrono::seconds(77));
  REQUIRE(mesh.get_group("dp").timeout() == world_timeout);
  REQUIRE(mesh.get_group("dp").backend_type() == BackendType::Gloo);
  // The same ranks with the world's timeout are another communicator.
  auto plain = init_device_mesh(c10::kCPU, {dp, tp}, {"dp", "tp"});
  REQUIRE(plain.get_group("tp").timeout() == world_timeout);
  REQUIRE(plain.get_group("tp") != mesh.get_group("tp"));
  REQUIRE(plain.get_group("dp") == mesh.get_group("dp")); // cached: same ranks, backend, timeout

  const auto full = global_value(2 * dp, 2 * tp);
  auto d = dtensor::distribute_tensor(full, mesh, {Placement::shard(0), Placement::shard(1)});
  CommDebugMode mode;
  REQUIRE(same(d.full_tensor(), full));
  REQUIRE(mode.count("tp", CollectiveKind::AllGather) == over(tp, 1));
  REQUIRE(mode.count("dp", CollectiveKind::AllGather) == over(dp, 1));

  SECTION("bad overrides name the dimension") {
    auto with = [&](dtensor::BackendOverride o) {
      return init_device_mesh(c10::kCPU, {dp, tp}, {"dp", "tp"}, DeviceMeshOptions().backend_override(o));
    };
    REQUIRE_THROWS_WITH(with({{std::string("pp"), GroupOptions()}}),
                        contains("backend_override names dimension 'pp', not one of (dp, tp)"));
    REQUIRE_THROWS_WITH(with({{int64_t{2}, GroupOptions()}}),
                        contains("backend_override names dimension 2, out of range"));
    REQUIRE_THROWS_WITH(with({{int64_t{1}, GroupOptions()}, {std::string("tp"), GroupOptions()}}),
                        contains("names dimension 1 twice"));
    REQUIRE_THROWS_WITH(with({{std::string("tp"), GroupOptions().backend(BackendType::Nccl)}}),
                        contains("dimension 'tp': backend nccl does not serve cpu tensors"));
    REQUIRE_THROWS_WITH(with({{std::string("dp"), GroupOptions().backend(BackendType::Fake)}}),
                        contains("dimension 'dp': backend fake outside a simulated world"));
    REQUIRE_THROWS_WITH(dtensor::new_group(iota(world()), "f", GroupOptions().backend(BackendType::Fake)),
                        contains("backend fake in a " + dtensor::to_string(dtensor::get_backend()) +
                                 " world"));
    REQUIRE_THROWS_WITH(dtensor::new_group(iota(world()), "t", GroupOptions().timeout(std::chrono::milliseconds(0))),
                        contains("timeout 0 ms must be > 0"));
  }
}
