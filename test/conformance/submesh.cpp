// Scenario "submesh" (sc_submesh.py): the DTensor entry points on mesh["dp"] / mesh["tp"].
#include <ATen/ATen.h>

#include "oracle.h"

namespace conformance::sc_submesh {
namespace {

using dtensor::DTensor;

at::Tensor data(int64_t rank) {
  // cases_util.gen(SHAPE, seed=rank + 1), computed the same way
  const double seed = static_cast<double>(rank + 1);
  at::Tensor base = at::arange(20, at::kDouble) * (0.37 + 0.013 * seed) + 0.5 * seed;
  return (base.sin() * 2).to(at::kFloat).reshape({5, 4});
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string key = c.str("key");
    const auto mesh = ctx.mesh(c.ints("mesh"))[c.str("sub")];
    const auto p = placement(c.str("placement"));
    std::optional<DTensor> d;
    {
      dtensor::CommDebugMode m;
      d = dtensor::distribute_tensor(data(ctx.rank), mesh, {p});
      ctx.results.tensor(key + " distribute#0", *d, &m);
    }
    {
      dtensor::CommDebugMode m;
      DTensor r = d->redistribute(mesh, {placement("R")});
      ctx.results.tensor(key + " redistribute R#0", r, &m);
    }
    ctx.results.tensor(key + " to_local#0", d->to_local());
    ctx.results.tensor(key + " from_local#0", DTensor::from_local(data(ctx.rank), mesh, {p}));
  }
}

[[maybe_unused]] const bool registered = register_scenario("submesh", run);

} // namespace
} // namespace conformance::sc_submesh
