// Scenario "fsdp_controls" (sc_fsdp_controls.py): FSDP2's training-recipe controls on
// MLPStack from the Python's initial values: gradient accumulation (gradient sync, HSDP
// all-reduce, is_last_backward), unshard(async_op), output_dtype / cast_forward_inputs
// through fsdp_forward, post-accumulate-grad hooks. Per-step records.
#include <torch/optim/adamw.h>

#include <models/mlp_models.h>

#include "oracle.h"

namespace conformance::sc_fsdp_controls {
namespace {

constexpr double kLr = 1e-2;

void set_flags(dtensor::FSDPModule& root, const std::string& mode, bool last) {
  if (mode == "no_sync") {
    root.set_requires_gradient_sync(last);
  } else if (mode == "no_all_reduce") {
    root.set_requires_all_reduce(last);
  } else if (mode == "not_last_backward") {
    root.set_is_last_backward(last);
  }
}

// PyTorch's name of a dtype (str(torch.float32) without "torch.").
std::string dtype_name(c10::ScalarType t) {
  return t == at::kFloat ? "float32" : t == at::kBFloat16 ? "bfloat16" : c10::toString(t);
}

struct Job {
  torch::nn::Sequential model;
  std::vector<dtensor::FSDPModule> blocks;
  dtensor::FSDPModule root;
};

Job shard(Ctx& ctx, const Case& c) {
  Job j{dtensor::models::mlp_stack(16), {}, {}};
  load_init(*j.model, c);
  auto mesh = c.str("layout") == "hsdp" ? ctx.mesh({2, ctx.world / 2}, {"replicate", "shard"})
                                        : ctx.mesh({ctx.world}, {"dp"});
  dtensor::MixedPrecisionPolicy mp;
  dtensor::MixedPrecisionPolicy root_mp;
  if (c.str("mode") == "output_dtype") {
    mp.param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
    root_mp = mp;
    root_mp.output_dtype(at::kFloat);
  }
  for (const auto& b : j.model->children()) {
    j.blocks.push_back(
        dtensor::fully_shard(*b, dtensor::FullyShardOptions().mesh(mesh).mp_policy(mp)));
  }
  j.root =
      dtensor::fully_shard(*j.model, dtensor::FullyShardOptions().mesh(mesh).mp_policy(root_mp));
  if (c.str("mode") == "post_acc_hook") {
    for (auto& p : j.model->parameters()) {
      dtensor::register_post_accumulate_grad_hook(p, [](const at::Tensor& param) {
        torch::NoGradGuard no_grad;
        at::Tensor(param).sub_(param.grad(), kLr);
      });
    }
  }
  return j;
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string key = c.str("key");
    const std::string mode = c.str("mode");
    Job j = shard(ctx, c);
    torch::optim::AdamW opt(j.model->parameters(), torch::optim::AdamWOptions(kLr));
    int64_t step = 0;
    for (const c10::IValue& mbs : c["inputs"].toListRef()) {
      const std::string k = key + " step" + std::to_string(step++);
      opt.zero_grad();
      const auto& micro = mbs.toListRef();
      {
        dtensor::CommDebugMode mode_counts;
        for (size_t m = 0; m < micro.size(); ++m) {
          set_flags(j.root, mode, m + 1 == micro.size());
          if (mode == "unshard_async") {
            j.blocks[0].unshard(/*async_op=*/true).wait();
          }
          const at::Tensor x = micro[m].toListRef().at(static_cast<size_t>(ctx.rank)).toTensor();
          // fsdp_forward: FSDP2's cast_forward_inputs / output_dtype around the root.
          const at::Tensor out = dtensor::fsdp_forward(j.model, x);
          const at::Tensor loss = out.sum();
          loss.backward();
          const std::string mb = k + " mb" + std::to_string(m);
          ctx.results.tensor(mb + " loss#0", loss.to(at::kFloat));
          ctx.results.value(mb + " output dtype", dtype_name(out.scalar_type()));
        }
        ctx.results.counts(k + " counts", mode_counts);
      }
      for (auto& item : j.model->named_parameters()) {
        ctx.results.tensor(k + " grad " + item.key() + "#0", item.value().grad());
      }
      if (mode != "post_acc_hook") {
        opt.step();
      }
      for (auto& item : j.model->named_parameters()) {
        ctx.results.tensor(k + " param " + item.key() + "#0", item.value());
      }
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("fsdp_controls", run);

} // namespace
} // namespace conformance::sc_fsdp_controls
