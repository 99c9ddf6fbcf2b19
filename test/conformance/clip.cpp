// Scenario "clip" (sc_clip.py): clip_grad_norm_ over fully_shard gradients, and model state
// dicts, on MLPStack from the Python's initial values.
#include <models/mlp_models.h>

#include "oracle.h"

namespace conformance::sc_clip {
namespace {

torch::nn::Sequential sharded_model(Ctx& ctx, const Case& c) {
  auto m = dtensor::models::mlp_stack(16);
  load_init(*m, c);
  auto mesh = c.str("layout") == "hsdp" ? ctx.mesh({2, ctx.world / 2}, {"replicate", "shard"})
                                        : ctx.mesh({ctx.world}, {"dp"});
  const auto opts = dtensor::FullyShardOptions().mesh(mesh);
  for (const auto& child : m->children()) {
    dtensor::fully_shard(*child, opts);
  }
  dtensor::fully_shard(*m, opts);
  return m;
}

void run_clip(Ctx& ctx, const Case& c, torch::nn::Sequential& m) {
  const std::string k = c.str("key");
  const c10::IValue xs = c["inputs"];
  m->forward(xs.toListRef().at(static_cast<size_t>(ctx.rank)).toTensor()).sum().backward();
  {
    dtensor::CommDebugMode mode;
    at::Tensor total = dtensor::clip_grad_norm_(m->parameters(), 0.1, c["norm"].toDouble());
    ctx.results.tensor(k + " total#0", total, &mode);
  }
  for (const auto& item : m->named_parameters()) {
    ctx.results.tensor(k + " grad " + item.key() + "#0", item.value().grad());
  }
}

void run_state_dict(Ctx& ctx, const Case& c, torch::nn::Sequential& m) {
  const std::string k = c.str("key");
  const dtensor::StateDict sd = dtensor::get_model_state_dict(*m);
  c10::List<std::string> keys;
  for (const auto& item : sd) {
    keys.push_back(item.key());
    ctx.results.tensor(k + " sharded " + item.key() + "#0", item.value());
  }
  ctx.results.value(k + " keys#0", keys);
  dtensor::StateDict full;
  {
    dtensor::CommDebugMode mode;
    full = dtensor::get_model_state_dict(*m, dtensor::StateDictOptions().full_state_dict(true));
    ctx.results.counts(k + " full counts#0", mode);
  }
  dtensor::StateDict doubled;
  for (const auto& item : full) {
    ctx.results.tensor(k + " full " + item.key() + "#0", item.value());
    doubled.insert(item.key(), item.value() * 2);
  }
  dtensor::set_model_state_dict(*m, doubled, dtensor::StateDictOptions().full_state_dict(true));
  for (const auto& item : m->named_parameters()) {
    ctx.results.tensor(k + " loaded " + item.key() + "#0", item.value());
  }
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    auto m = sharded_model(ctx, c);
    if (c.str("kind") == "clip") {
      run_clip(ctx, c, m);
    } else {
      run_state_dict(ctx, c, m);
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("clip", run);

} // namespace
} // namespace conformance::sc_clip
