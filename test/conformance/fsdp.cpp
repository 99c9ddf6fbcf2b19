// Scenario "fsdp" (sc_fsdp.py): fully_shard training of MLPStack and the Transformer from
// the Python's initial values, AdamW, per-step records.
#include <torch/optim/adamw.h>

#include <models/fsdp_models.h>
#include <models/mlp_models.h>

#include "oracle.h"

namespace conformance::sc_fsdp {
namespace {

struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  std::function<at::Tensor(const at::Tensor&)> forward;
};

// "fp32 ac=full" / "fp32 ac=selective": activation checkpointing per block (sc_fsdp.py).
std::optional<dtensor::ActivationCheckpointOptions> ac_of(const std::string& dtype) {
  if (dtype.find("ac=full") != std::string::npos) {
    return dtensor::ActivationCheckpointOptions();
  }
  if (dtype.find("ac=selective") != std::string::npos) { // torchtitan's "op" policy
    return dtensor::ActivationCheckpointOptions().policy(
        dtensor::save_ops({"aten::mm", "aten::addmm", "aten::bmm",
                           "aten::_scaled_dot_product_flash_attention_for_cpu"}));
  }
  return std::nullopt;
}

Model make_model(const std::string& name, const std::string& dtype) {
  using namespace dtensor::models;
  if (name == "mlp") {
    auto seq = mlp_stack(16);
    Model m{seq.ptr(), {}, [seq](const at::Tensor& x) mutable { return seq->forward(x); }};
    for (const auto& child : seq->children()) {
      m.blocks.push_back(child);
    }
    return m;
  }
  Transformer t(ModelArgs()
                    .n_layers(2)
                    .vocab_size(8)
                    .max_seq_len(16)
                    .dim(16)
                    .n_heads(4)
                    .dropout_p(0.0)
                    .activation_checkpoint(ac_of(dtype)));
  Model m{t.ptr(), {}, [t](const at::Tensor& x) mutable { return t->forward(x); }};
  for (const auto& layer : t->layers->children()) {
    m.blocks.push_back(layer);
  }
  return m;
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string key = c.str("key");
    Model m = make_model(c.str("model"), c.str("dtype"));
    load_init(*m.module, c);
    const bool hsdp = c.str("layout") == "hsdp";
    auto mesh =
        hsdp ? ctx.mesh({2, ctx.world / 2}, {"replicate", "shard"}) : ctx.mesh({ctx.world}, {"dp"});
    dtensor::MixedPrecisionPolicy mp;
    const bool bf16 = c.str("dtype") == "bf16";
    if (bf16) {
      mp.param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
    }
    auto opts = dtensor::FullyShardOptions()
                    .mesh(mesh)
                    .reshard_after_forward(c["reshard"].toBool())
                    .mp_policy(mp);
    for (auto& b : m.blocks) {
      dtensor::fully_shard(*b, opts);
    }
    dtensor::fully_shard(*m.module, opts);
    torch::optim::AdamW opt(m.module->parameters(), torch::optim::AdamWOptions(1e-2));
    const c10::IValue steps = c["inputs"];
    int64_t step = 0;
    for (const c10::IValue& xs : steps.toListRef()) {
      const std::string k = key + " step" + std::to_string(step++);
      opt.zero_grad();
      at::Tensor x = xs.toListRef().at(static_cast<size_t>(ctx.rank)).toTensor();
      if (bf16 && x.is_floating_point()) {
        x = x.to(at::kBFloat16); // [Note: no input casting] in fully_shard.h
      }
      at::Tensor loss;
      {
        dtensor::CommDebugMode mode;
        loss = m.forward(x).sum();
        loss.backward();
        ctx.results.tensor(k + " loss#0", loss.to(at::kFloat), &mode);
      }
      ctx.results.step(k, *m.module, opt);
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("fsdp", run);

} // namespace
} // namespace conformance::sc_fsdp
