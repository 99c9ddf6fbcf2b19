// Scenario "factories" (sc_factories.py): dtensor's zeros / ones / full / empty / rand /
// randn on the same meshes, placements, shapes and dtypes.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "oracle.h"

namespace conformance::sc_factories {
namespace {

using dtensor::DTensor;

constexpr double kFill = 2.5;

std::string describe(const DTensor& t) {
  const std::string dtype = t.scalar_type() == at::kDouble ? "torch.float64" : "torch.float32";
  return fmt::format("{} [{}] local [{}] {} rg={}", names_of(t.placements()),
                     fmt::join(t.sizes(), ", "), fmt::join(t.to_local().sizes(), ", "), dtype,
                     t.requires_grad() ? "True" : "False");
}

DTensor make(const Case& c, const dtensor::DeviceMesh& mesh) {
  const std::string fac = c.str("factory");
  const std::vector<int64_t> shape = c.ints("shape");
  const auto placements = conformance::placements(c.strings("placements"));
  const at::TensorOptions options = at::TensorOptions()
                                        .dtype(c.str("dtype") == "float64" ? at::kDouble
                                               : c.str("dtype") == "int64" ? at::kLong
                                                                           : at::kFloat)
                                        .requires_grad(c["requires_grad"].toBool());
  if (fac == "zeros") {
    return dtensor::zeros(shape, mesh, placements, options);
  }
  if (fac == "ones") {
    return dtensor::ones(shape, mesh, placements, options);
  }
  if (fac == "full") {
    return dtensor::full(shape, kFill, mesh, placements, options);
  }
  if (fac == "empty") {
    return dtensor::empty(shape, mesh, placements, options);
  }
  if (fac == "rand") {
    return dtensor::rand(shape, mesh, placements, options);
  }
  return dtensor::randn(shape, mesh, placements, options);
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string key = c.str("key");
    const std::vector<int64_t> shape = c.ints("mesh");
    const auto mesh = ctx.mesh(shape, shape.size() == 1 ? std::vector<std::string>{"x"}
                                                        : std::vector<std::string>{"dp", "tp"});
    const std::string fac = c.str("factory");
    try {
      dtensor::CommDebugMode m;
      DTensor t = make(c, mesh);
      if (fac == "zeros" || fac == "ones" || fac == "full") {
        ctx.results.tensor(key + "#0", t, &m);
      } else {
        ctx.results.value(key + "#0", describe(t), &m);
        if (fac == "rand") {
          const at::Tensor local = t.to_local();
          ctx.results.value(key + "#1", (local.ge(0) & local.lt(1)).all().item<bool>());
        }
      }
    } catch (const std::exception& e) {
      ctx.results.error(key + "#0", e);
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("factories", run);

} // namespace
} // namespace conformance::sc_factories
