// Scenario "redistribute" (sc_redistribute.py): from_local with each rank's local tensor,
// then redistribute to the destination placements under CommDebugMode.
#include "oracle.h"

namespace conformance::sc_redistribute {
namespace {

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string key = c.str("key");
    auto mesh = ctx.mesh(c.ints("mesh"));
    const std::vector<int64_t> shape = c.ints("shape");
    const auto src = dtensor::DTensor::from_local(c.tensor_at("locals", ctx.rank), mesh,
                                                  placements(c.strings("src")), shape);
    try {
      dtensor::CommDebugMode mode;
      dtensor::DTensor out = src.redistribute(mesh, placements(c.strings("dst")));
      ctx.results.tensor(key, out, &mode);
    } catch (const std::exception& e) {
      ctx.results.error(key, e);
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("redistribute", run);

} // namespace
} // namespace conformance::sc_redistribute
