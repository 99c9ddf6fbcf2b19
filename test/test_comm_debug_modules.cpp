// CommDebugMode per module ([Note: module attribution]): counts per module on a
// tensor-parallel MLP run through traced_forward, against the counts PyTorch's tracker gives
// (the conformance scenario "debug" compares the printed views with PyTorch's; this file the
// API: counts, noise levels, the file and JSON writers, reset, activation checkpointing), and
// the plain model's values.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <models/common_dtensor.h>
#include <nlohmann/json.hpp>

#include "support/prelude.h"

using dtensor::traced_forward;
using dtensor::models::MLPModule;

namespace {

MLPModule parallel_mlp() {
  MLPModule m;
  auto mesh = init_device_mesh(c10::kCPU, {world()}, {"tp"});
  dtensor::parallelize_module(*m, mesh,
                              {{"net1", std::make_shared<dtensor::ColwiseParallel>()},
                               {"net2", std::make_shared<dtensor::RowwiseParallel>()}});
  return m;
}

at::Tensor input() {
  return at::linspace(-1, 1, 40).reshape({4, 10});
}

std::string read(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

int64_t n(const std::map<CollectiveKind, int64_t>& counts, CollectiveKind kind) {
  auto it = counts.find(kind);
  return it == counts.end() ? 0 : it->second;
}

// A module's all-reduces in forward or backward (0 for a module that saw no collective).
using Counts = std::map<std::string, CommDebugMode::ModuleCollectives>;
int64_t all_reduces(const Counts& counts, const std::string& module, bool backward) {
  auto it = counts.find(module);
  return it == counts.end() ? 0
                            : n(backward ? it->second.backward : it->second.forward,
                                CollectiveKind::AllReduce);
}

} // namespace

TEST_CASE("collectives counted per module, forward and backward, as PyTorch's tracker",
          "[comm_modules][world1][world2][world4]") {
  auto model = parallel_mlp();
  MLPModule plain;
  at::Tensor x = input().requires_grad_(true);
  at::Tensor x_plain = input().requires_grad_(true);
  const at::Tensor expected = plain->forward(x_plain);
  expected.sum().backward();

  CommDebugMode mode;
  at::Tensor out = traced_forward(model, x);
  out.sum().backward();
  // Values against the plain model; outputs and the input's gradient are plain, as PyTorch's.
  REQUIRE(!dtensor::is_dtensor(out));
  REQUIRE(!dtensor::is_dtensor(x.grad()));
  REQUIRE(close(out, expected));
  REQUIRE(close(x.grad(), x_plain.grad()));

  const auto counts = mode.comm_module_counts();
  const int64_t one = over(world(), 1);
  // RowwiseParallel's output all-reduce in net2's forward; the input gradient's in net1's
  // backward; each also counted by the ancestors.
  REQUIRE(all_reduces(counts, "MLPModule.net2", false) == one);
  REQUIRE(all_reduces(counts, "MLPModule.net2", true) == 0);
  REQUIRE(all_reduces(counts, "MLPModule.net1", true) == one);
  REQUIRE(all_reduces(counts, "MLPModule.net1", false) == 0);
  for (const char* m : {"MLPModule", "Global"}) {
    REQUIRE(all_reduces(counts, m, false) == one);
    REQUIRE(all_reduces(counts, m, true) == one);
  }
  REQUIRE(counts.count("MLPModule.relu") == 0); // saw no collective (PyTorch's dict has no entry)
  REQUIRE(mode.total_count() == 2 * one);

  SECTION("noise levels") {
    const std::string t0 = mode.generate_comm_debug_tracing_table(0);
    REQUIRE(t0.find("    MLPModule\n") != std::string::npos);
    REQUIRE(t0.find("        MLPModule.relu\n") != std::string::npos);
    REQUIRE(t0.find("*module type") == std::string::npos);
    REQUIRE(t0.find("**aten") == std::string::npos);
    const std::string t1 = mode.generate_comm_debug_tracing_table(1);
    REQUIRE(t1.find("        *module type: class 'torch::nn::LinearImpl'\n") != std::string::npos);
    REQUIRE(t1.find("         *weight: (Shard(dim=0),)\n") != std::string::npos);
    REQUIRE(t1.find("         *weight: (Shard(dim=1),)\n") != std::string::npos);
    // net1's product as PyTorch lists it: bias, input (Replicate after the style's
    // conversion), the transposed weight.
    const std::string mesh = "DeviceMesh((tp=" + std::to_string(world()) + "), 'cpu', stride=(1,))";
    REQUIRE(t1.find("**aten.addmm.default\x1b[0m\n\x1b[1;31m              shape: [torch.Size([16]), "
                    "torch.Size([4, 10]), torch.Size([10, 16])]\x1b[0m\n\x1b[1;31m              "
                    "sharding: [(Shard(dim=0),), (Replicate(),), (Shard(dim=1),)]\x1b[0m\n"
                    "\x1b[1;31m              device mesh: " + mesh) != std::string::npos);
    REQUIRE(t1.find("**aten.t.default") == std::string::npos); // trivial: level 3 only
    REQUIRE(mode.generate_comm_debug_tracing_table(3).find("**aten.t.default") != std::string::npos);
  }

  SECTION("the file and JSON writers") {
    const std::string dir = dtensor::testing::fresh_shared_dir("comm_modules", "writers");
    std::filesystem::create_directories(dir);
    const std::string txt = dir + "/rank" + std::to_string(rank()) + ".txt";
    mode.log_comm_debug_tracing_table_to_file(txt, 1);
    const std::string text = read(txt);
    REQUIRE(text.find('\x1b') == std::string::npos);
    REQUIRE(text.find("MLPModule.net2") != std::string::npos);
    const std::string js = dir + "/rank" + std::to_string(rank()) + ".json";
    mode.generate_json_dump(js, 1);
    auto j = nlohmann::json::parse(read(js));
    REQUIRE(j["fqn"] == "Global");
    REQUIRE(j["children"].size() == 1);
    const auto& root = j["children"][0];
    REQUIRE(root["fqn"] == "MLPModule");
    REQUIRE(root["children"].size() == 3);
    const auto& net1 = root["children"][0];
    REQUIRE(net1["fqn"] == "MLPModule.net1");
    REQUIRE(net1["module_type"] == "class 'torch::nn::LinearImpl'");
    REQUIRE(net1["parameters"] == nlohmann::json::parse(R"j([["weight", "(Shard(dim=0),)"], ["bias", "(Shard(dim=0),)"]])j"));
    if (world() > 1) {
      REQUIRE(net1["collectives_backward"] == nlohmann::json::parse(R"j([["c10d_functional.all_reduce", 1]])j"));
    }
    REQUIRE(net1["operations_forward"][0]["name"] == "aten.addmm.default");
    REQUIRE(net1["operations_forward"][0]["is_bw"] == false);
    REQUIRE(!net1["operations_backward"].empty());
    REQUIRE(net1["operations_backward"][0]["is_bw"] == true);
    REQUIRE_THROWS_WITH(mode.generate_json_dump(dir + "/missing/dir/x.json"),
                        contains("cannot open '" + dir + "/missing/dir/x.json' for writing"));
  }

  SECTION("sharding and parameter info") {
    const auto sharding = mode.get_sharding_info();
    REQUIRE(sharding.at("MLPModule.net1.weight") == "(Shard(dim=0),)");
    REQUIRE(sharding.at("MLPModule.net2.bias") == "(Replicate(),)");
    REQUIRE(sharding.size() == 4);
    const auto params = mode.get_parameter_info();
    REQUIRE(params.at("MLPModule.net1").at("weight").is_same(model->net1->weight));
    REQUIRE(params.count("MLPModule.relu") == 0);
  }

  SECTION("reset keeps the modules, clears the counts") {
    mode.reset();
    REQUIRE(mode.comm_module_counts().size() == 1); // Global, empty
    REQUIRE(mode.generate_comm_debug_tracing_table(0).find("MLPModule.net2") != std::string::npos);
  }
}

TEST_CASE("activation checkpointing's recompute is listed apart, its collectives as backward",
          "[comm_modules][world1][world2][world4]") {
  auto model = parallel_mlp();
  at::Tensor x = input().requires_grad_(true);
  CommDebugMode mode;
  at::Tensor out = dtensor::activation_checkpoint(
      [&](const at::Tensor& in) { return traced_forward(model, in); }, x);
  out.sum().backward();
  const std::string t1 = mode.generate_comm_debug_tracing_table(1);
  REQUIRE(t1.find("ACTIVATION CHECKPOINTING") != std::string::npos);
  const auto j = nlohmann::json::parse(mode.json_dump(1));
  const auto& net1 = j["children"][0]["children"][0];
  REQUIRE(net1["fqn"] == "MLPModule.net1");
  REQUIRE(!net1["operations_checkpointing"].empty());
  REQUIRE(net1["operations_checkpointing"][0]["name"] == "aten.addmm.default");
  REQUIRE(net1["operations_checkpointing"][0]["is_activation_checkpointing"] == true);
  // Forward: net2's all-reduce; backward: the input gradient's and the recompute's own
  // conversion of net2's output. dtensor differentiates the recomputed graph from its
  // outputs, so the recompute runs the model to its end, net2's output hook included (its
  // tensor-parallel conversion must be in that graph: [Note: tensor parallelism on the module
  // seam]); PyTorch's non-reentrant checkpoint stops recomputing once it has the saved
  // tensors it needs, before that hook, one all-reduce fewer. Only a checkpointed region
  // that ends in a row-wise output pays it (a block ends in a residual sum, which uses the
  // converted value anyway).
  const auto counts = mode.comm_module_counts();
  REQUIRE(all_reduces(counts, "Global", false) == over(world(), 1));
  REQUIRE(all_reduces(counts, "Global", true) == over(world(), 2));
  REQUIRE(close(x.grad(), [] {
    MLPModule plain;
    at::Tensor xp = input().requires_grad_(true);
    plain->forward(xp).sum().backward();
    return xp.grad();
  }()));
}
