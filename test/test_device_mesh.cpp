// DeviceMesh: coordinates, per-dimension groups, slicing, flattening, equality, errors.
#include <unordered_set>

#include "support/prelude.h"

namespace {

// Each rank learns the ranks of its group by gathering them over the group itself: the
// communicator, not just the bookkeeping, must connect exactly those ranks.
std::vector<int> ranks_seen_through(const dtensor::Group& g) {
  auto mine = dtensor::testing::tensor({static_cast<double>(rank())}, at::kLong);
  auto all = dtensor::all_gather_tensor(mine, 0, g).cpu();
  std::vector<int> out;
  for (int64_t i = 0; i < all.numel(); ++i) {
    out.push_back(static_cast<int>(all[i].item<int64_t>()));
  }
  return out;
}

} // namespace

TEST_CASE("1-D mesh over the world", "[mesh][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  REQUIRE(mesh.ndim() == 1);
  REQUIRE(mesh.size() == world());
  REQUIRE(mesh.size(0) == world());
  REQUIRE(mesh.get_coordinate() == std::vector<int64_t>{rank()});
  REQUIRE(mesh.get_local_rank(0) == rank());
  REQUIRE(mesh.get_local_rank("dp") == rank());
  REQUIRE(mesh.get_group().label() == "dp");
  REQUIRE(mesh.get_group() == dtensor::world_group()); // same communicator, reused
  std::vector<int> all;
  for (int r = 0; r < world(); ++r) {
    all.push_back(r);
  }
  REQUIRE(ranks_seen_through(mesh.get_group("dp")) == all);
  REQUIRE(mesh.ranks() == all);
}

TEST_CASE("2-D mesh (dp=2, tp=2): coordinates and groups", "[mesh][world4]") {
  auto mesh = init_device_mesh(device_type(), {2, 2}, {"dp", "tp"});
  int r = rank();
  REQUIRE(mesh.shape() == std::vector<int64_t>{2, 2});
  REQUIRE(mesh.get_coordinate() == std::vector<int64_t>{r / 2, r % 2});
  REQUIRE(mesh.get_local_rank("dp") == r / 2);
  REQUIRE(mesh.get_local_rank("tp") == r % 2);
  // dp groups {0,2} {1,3}; tp groups {0,1} {2,3}.
  REQUIRE(mesh.get_group("dp").ranks() == std::vector<int>{r % 2, r % 2 + 2});
  REQUIRE(mesh.get_group("tp").ranks() == std::vector<int>{r - r % 2, r - r % 2 + 1});
  REQUIRE(ranks_seen_through(mesh.get_group("dp")) == std::vector<int>{r % 2, r % 2 + 2});
  REQUIRE(ranks_seen_through(mesh.get_group(1)) == std::vector<int>{r - r % 2, r - r % 2 + 1});
  REQUIRE(mesh.get_group(0).label() == "dp");
  REQUIRE(mesh.get_group(-1).label() == "tp");
  REQUIRE(mesh.get_all_groups().size() == 2);
  REQUIRE(mesh.to_string() == "DeviceMesh(" + std::string(device_type() == c10::kCPU ? "cpu" : "cuda") +
                                  ", [[0, 1], [2, 3]], names=(dp, tp))");

  SECTION("slicing one dimension") {
    auto tp = mesh["tp"];
    REQUIRE(tp.ndim() == 1);
    REQUIRE(tp.ranks() == std::vector<int>{r - r % 2, r - r % 2 + 1});
    REQUIRE(tp.get_coordinate() == std::vector<int64_t>{r % 2});
    REQUIRE(tp.get_group() == mesh.get_group("tp"));
    REQUIRE(tp.dim_names() == std::vector<std::string>{"tp"});
    auto dp = mesh["dp"];
    REQUIRE(dp.ranks() == std::vector<int>{r % 2, r % 2 + 2});
    REQUIRE(dp.get_local_rank(0) == r / 2);
  }
  SECTION("slicing both dimensions transposed") {
    auto t = mesh[{"tp", "dp"}];
    REQUIRE(t.shape() == std::vector<int64_t>{2, 2});
    REQUIRE(t.ranks() == std::vector<int>{0, 2, 1, 3});
    REQUIRE(t.get_coordinate() == std::vector<int64_t>{r % 2, r / 2});
    REQUIRE(t.get_group("dp") == mesh.get_group("dp"));
    REQUIRE(t != mesh);
    REQUIRE(mesh[{"dp", "tp"}] == mesh);
  }
  SECTION("flatten makes one group over all ranks and registers its name") {
    int64_t before = dtensor::num_groups_created();
    auto flat = mesh.flatten();
    REQUIRE(flat.dim_names() == std::vector<std::string>{"dp_tp"});
    REQUIRE(flat.ranks() == std::vector<int>{0, 1, 2, 3});
    REQUIRE(flat.get_local_rank(0) == r);
    REQUIRE(dtensor::num_groups_created() == before); // the world group is reused
    REQUIRE(mesh["dp_tp"] == flat);
    REQUIRE(ranks_seen_through(mesh["dp_tp"].get_group()) == std::vector<int>{0, 1, 2, 3});
    auto tflat = mesh[{"tp", "dp"}].flatten("tp_dp");
    REQUIRE(tflat.ranks() == std::vector<int>{0, 2, 1, 3});
    REQUIRE(tflat.get_local_rank(0) == (r % 2) * 2 + r / 2);
    REQUIRE(ranks_seen_through(tflat.get_group()) == std::vector<int>{0, 2, 1, 3});
    REQUIRE_THROWS_WITH((mesh[{"dp_tp", "dp"}]), contains("dimension 'dp' overlaps another selected "
                                                        "dimension in (dp_tp, dp)"));
    REQUIRE_THROWS_WITH(mesh["tp"].flatten("tp_dp"),
                        contains("name 'tp_dp' already names a flattening of other dimensions"));
  }
}

TEST_CASE("3-D mesh (dp=2, cp=1, tp=2): slicing and flattening", "[mesh][world4]") {
  auto mesh = init_device_mesh(device_type(), {2, 1, 2}, {"dp", "cp", "tp"});
  int r = rank();
  REQUIRE(mesh.get_coordinate() == std::vector<int64_t>{r / 2, 0, r % 2});
  REQUIRE(mesh.get_group("cp").ranks() == std::vector<int>{r});
  REQUIRE(mesh.get_group("cp").size() == 1);
  auto dp_cp = mesh[{"dp", "cp"}].flatten();
  REQUIRE(dp_cp.dim_names() == std::vector<std::string>{"dp_cp"});
  REQUIRE(dp_cp.ranks() == std::vector<int>{r % 2, r % 2 + 2});
  auto sub = mesh[{"dp_cp", "tp"}];
  REQUIRE(sub.shape() == std::vector<int64_t>{2, 2});
  REQUIRE(sub.ranks() == std::vector<int>{0, 1, 2, 3});
  REQUIRE(sub.get_group("dp_cp").ranks() == std::vector<int>{r % 2, r % 2 + 2});
  REQUIRE(sub.get_coordinate() == std::vector<int64_t>{r / 2, r % 2});
}

TEST_CASE("2-D mesh on 2 ranks (dp=1, tp=2)", "[mesh][world2]") {
  auto mesh = init_device_mesh(device_type(), {1, 2}, {"dp", "tp"});
  REQUIRE(mesh.get_coordinate() == std::vector<int64_t>{0, rank()});
  REQUIRE(mesh.get_group("dp").size() == 1);
  REQUIRE(mesh.get_group("tp").ranks() == std::vector<int>{0, 1});
  REQUIRE(mesh["tp"].get_group() == dtensor::world_group());
}

TEST_CASE("mesh equality and hashing", "[mesh][world1][world2][world4]") {
  auto a = init_device_mesh(device_type(), {world()}, {"dp"});
  auto b = init_device_mesh(device_type(), {world()}, {"dp"});
  auto c = init_device_mesh(device_type(), {world()}, {"x"});
  auto unnamed = init_device_mesh(device_type(), {world()});
  REQUIRE(a == b);
  REQUIRE(a.hash() == b.hash());
  REQUIRE(a != c);
  REQUIRE(a != unnamed);
  REQUIRE(unnamed.get_group(0).label() == "dim0");
  std::unordered_set<DeviceMesh> set{a, b, c};
  REQUIRE(set.size() == 2);
  REQUIRE(a["dp"] == a);
}

TEST_CASE("mesh errors name the mesh and the bad value", "[mesh][world1][world2][world4]") {
  auto dev = device_type();
  int w = world();
  REQUIRE_THROWS_WITH(init_device_mesh(dev, {w + 1}),
                      contains("the mesh has " + std::to_string(w + 1) + " ranks but the world has " +
                               std::to_string(w)));
  REQUIRE_THROWS_WITH(init_device_mesh(dev, {w, 1}, {"dp", "dp"}),
                      contains("dimension name 'dp' appears twice"));
  REQUIRE_THROWS_WITH(init_device_mesh(dev, {w, 1}, {"dp"}), contains("1 names for 2 dimensions"));
  REQUIRE_THROWS_WITH(init_device_mesh(dev, {}), contains("at least one dimension"));
  REQUIRE_THROWS_WITH(init_device_mesh(dev, {w, 0}), contains("sizes must be positive"));
  auto mesh = init_device_mesh(dev, {w, 1}, {"dp", "tp"});
  std::string shown = mesh.to_string();
  REQUIRE_THROWS_WITH(mesh["pp"], contains("no dimension named 'pp' in " + shown));
  REQUIRE_THROWS_WITH(mesh.get_group(2), contains("dim 2 is out of range for " + shown));
  REQUIRE_THROWS_WITH(mesh.get_group(-3), contains("dim -3 is out of range"));
  REQUIRE_THROWS_WITH(mesh.size(5), contains("dim 5 is out of range"));
  REQUIRE_THROWS_WITH(mesh.get_local_rank(7), contains("dim 7 is out of range"));
  REQUIRE_THROWS_WITH(mesh.get_group(), contains("has 2 dimensions; name the dimension"));
  REQUIRE_THROWS_WITH(mesh.flatten("dp"), contains("name 'dp' is already a dimension"));
  auto unnamed = init_device_mesh(dev, {w});
  REQUIRE_THROWS_WITH(unnamed["dp"], contains("has no dimension names"));
  REQUIRE_THROWS_WITH(unnamed.flatten(), contains("has no dimension names; pass a name"));
  auto wrong = dev == c10::DeviceType::CPU ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  if (dev == c10::DeviceType::CPU) { // a CPU mesh in an NCCL world runs on Gloo
    REQUIRE_THROWS_WITH(init_device_mesh(wrong, {w}), contains("does not match the process group's"));
  }
  REQUIRE_THROWS_WITH(init_device_mesh(c10::DeviceType::Meta, {w}),
                      contains("device type must be cpu or cuda"));
}
