// Scenario "debug" (sc_debug.py): visualize_sharding's table and CommDebugMode per module
// (tracing table, JSON dump, sharding and parameter info) on a tensor-parallel model.
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <models/common_dtensor.h>

#include "oracle.h"

namespace conformance::sc_debug {
namespace {

using dtensor::DTensor;
using dtensor::traced_forward;

// sc_debug.py's models.
using dtensor::models::MLPModule;
using dtensor::models::MLPModuleStack;

// What `fn` prints on std::cout.
template <typename F>
std::string printed(F&& fn) {
  std::ostringstream out;
  std::streambuf* old = std::cout.rdbuf(out.rdbuf());
  try {
    fn();
  } catch (...) {
    std::cout.rdbuf(old);
    throw;
  }
  std::cout.rdbuf(old);
  return out.str();
}

void vis(Ctx& ctx, const Case& c) {
  const auto mesh = ctx.mesh(c.ints("mesh"), c.strings("names"));
  const auto names = c.strings("placements");
  const auto pls = placements(names);
  const auto shape = c.ints("shape");
  at::Tensor full =
      at::sin(at::arange(c10::multiply_integers(shape), at::kDouble) * (0.37 + 0.013 * 3) + 1.5)
          .mul(2)
          .to(at::kFloat)
          .reshape(shape);
  const bool partial = std::find(names.begin(), names.end(), "P") != names.end();
  DTensor t =
      partial ? DTensor::from_local(full, mesh, pls) : dtensor::distribute_tensor(full, mesh, pls);
  ctx.results.value(c.str("key") + " printed#0", printed([&] { dtensor::visualize_sharding(t); }));
}

// sc_debug.py's module_lines: the table without colours, module types, operations and pass
// headers.
std::string module_lines(const std::string& table) {
  static const std::regex ansi("\x1B\\[[0-?]*[ -/]*[@-~]");
  std::istringstream in(std::regex_replace(table, ansi, ""));
  std::vector<std::string> keep;
  for (std::string line; std::getline(in, line);) {
    const auto first = line.find_first_not_of(' ');
    const std::string s = first == std::string::npos ? "" : line.substr(first);
    if (s.rfind("*module type", 0) == 0 || s.rfind("**", 0) == 0 || s.rfind("shape:", 0) == 0 ||
        s.rfind("sharding:", 0) == 0 || s.rfind("device mesh:", 0) == 0 || s == "FORWARD PASS" ||
        s == "BACKWARD PASS" || s == "ACTIVATION CHECKPOINTING") {
      continue;
    }
    keep.push_back(line);
  }
  std::string out;
  for (size_t i = 0; i < keep.size(); ++i) {
    out += (i ? "\n" : "") + keep[i];
  }
  return out;
}

// The views compared with PyTorch's.
void record_views(Ctx& ctx, const std::string& k, const dtensor::CommDebugMode& mode) {
  ctx.results.value(k + " table0#0", mode.generate_comm_debug_tracing_table(0));
  ctx.results.value(k + " table1 modules#0",
                    module_lines(mode.generate_comm_debug_tracing_table(1)));
  // Through the file, as PyTorch's side reads its own.
  const std::string path = fmt::format("{}/dtensor-dump-{}.json", ctx.outdir, ctx.rank);
  mode.generate_json_dump(path, 0);
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  ctx.results.value(k + " json0#0", text.str());
  c10::Dict<std::string, std::string> sharding;
  for (const auto& [name, placements] : mode.get_sharding_info()) {
    sharding.insert(name, placements);
  }
  ctx.results.value(k + " sharding#0", sharding);
  c10::Dict<std::string, c10::List<std::string>> params;
  for (const auto& [module, ps] : mode.get_parameter_info()) {
    c10::List<std::string> names; // sorted (sc_debug.py sorts PyTorch's)
    for (const auto& [name, tensor] : ps) {
      names.push_back(name);
    }
    params.insert(module, names);
  }
  ctx.results.value(k + " parameters#0", params);
}

void modules(Ctx& ctx, const Case& c) {
  const bool mlp = c.str("model") == "mlp";
  std::vector<std::shared_ptr<torch::nn::Module>> mlps;
  MLPModule one{nullptr};
  MLPModuleStack stack{nullptr};
  if (mlp) {
    one = MLPModule();
    mlps = {one.ptr()};
  } else {
    stack = MLPModuleStack();
    for (const auto& l : *stack->layers) {
      mlps.push_back(l);
    }
  }
  const auto mesh = ctx.mesh({ctx.world}, {"tp"});
  for (const auto& m : mlps) {
    dtensor::parallelize_module(*m, mesh,
                                {{"net1", std::make_shared<dtensor::ColwiseParallel>()},
                                 {"net2", std::make_shared<dtensor::RowwiseParallel>()}});
  }
  at::Tensor x = c["input"].toTensor().clone().requires_grad_(true);
  const std::string k = c.str("key");
  at::Tensor out;
  {
    dtensor::CommDebugMode mode;
    out = mlp ? traced_forward(one, x) : traced_forward(stack, x);
    out.sum().backward();
    record_views(ctx, k, mode);
  }
  ctx.results.tensor(k + " out#0", out); // after the mode: full_tensor's collectives
  ctx.results.tensor(k + " input grad#0", x.grad());
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    std::optional<std::string> err;
    try {
      if (c.str("kind") == "vis") {
        vis(ctx, c);
      } else {
        modules(ctx, c);
      }
    } catch (const std::exception& e) {
      err = e.what();
    }
    err = ctx.agree_error(err);
    if (err) {
      ctx.results.error(c.str("key") + "#error", std::runtime_error(*err));
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("debug", run);

} // namespace
} // namespace conformance::sc_debug
