// Scenario "misuse" (sc_misuse.py): bad input, case by case, as the Python does it.
#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "oracle.h"

namespace conformance::sc_misuse {
namespace {

using dtensor::DTensor;
using dtensor::Placement;
using Fn = std::function<at::Tensor(Ctx&)>;

dtensor::DeviceMesh mesh1(Ctx& ctx) {
  return ctx.mesh({ctx.world}, {"x"});
}
dtensor::DeviceMesh mesh_y(Ctx& ctx) {
  return ctx.mesh({ctx.world}, {"y"});
}
at::Tensor ones(std::vector<int64_t> s) {
  return at::ones(s);
}

torch::nn::Linear sharded_linear(Ctx& ctx) {
  torch::nn::Linear lin(4, 4);
  dtensor::fully_shard(*lin, dtensor::FullyShardOptions().mesh(mesh1(ctx)));
  return lin;
}

const std::map<std::string, Fn>& cases() {
  static const std::map<std::string, Fn> table = {
      {"shard_dim_out_of_range",
       [](Ctx& ctx) {
         return dtensor::distribute_tensor(ones({4, 4}), mesh1(ctx), {Placement::shard(2)});
       }},
      {"too_many_placements",
       [](Ctx& ctx) {
         return dtensor::distribute_tensor(ones({4, 4}), mesh1(ctx),
                                           {Placement::shard(0), Placement::replicate()});
       }},
      {"redistribute_wrong_length",
       [](Ctx& ctx) {
         auto d = dtensor::distribute_tensor(ones({4, 4}), mesh1(ctx), {Placement::shard(0)});
         return d.redistribute(mesh1(ctx), {Placement::replicate(), Placement::replicate()});
       }},
      {"from_local_wrong_length",
       [](Ctx& ctx) {
         return DTensor::from_local(ones({2, 4}), mesh1(ctx),
                                    {Placement::shard(0), Placement::shard(1)});
       }},
      {"different_meshes",
       [](Ctx& ctx) {
         auto a = dtensor::distribute_tensor(ones({4, 4}), mesh1(ctx), {Placement::shard(0)});
         auto b = dtensor::distribute_tensor(ones({4, 4}), mesh_y(ctx), {Placement::shard(0)});
         return a + b;
       }},
      {"plain_tensor_mixed",
       [](Ctx& ctx) {
         return dtensor::distribute_tensor(ones({4, 4}), mesh1(ctx), {Placement::shard(0)}) +
                ones({4, 4});
       }},
      {"mm_inner_mismatch",
       [](Ctx& ctx) {
         auto a = dtensor::distribute_tensor(ones({4, 6}), mesh1(ctx), {Placement::shard(0)});
         auto b = dtensor::distribute_tensor(ones({5, 4}), mesh1(ctx), {Placement::replicate()});
         return at::mm(a, b);
       }},
      {"view_bad_size",
       [](Ctx& ctx) {
         return dtensor::distribute_tensor(ones({4, 6}), mesh1(ctx), {Placement::shard(0)})
             .view({5, 5});
       }},
      {"fully_shard_twice",
       [](Ctx& ctx) {
         torch::nn::Linear m(4, 4);
         dtensor::fully_shard(*m, dtensor::FullyShardOptions().mesh(mesh1(ctx)));
         dtensor::fully_shard(*m, dtensor::FullyShardOptions().mesh(mesh1(ctx)));
         return at::Tensor();
       }},
      {"colwise_on_layernorm",
       [](Ctx& ctx) {
         torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({4}));
         dtensor::parallelize_module(*ln, mesh1(ctx), std::make_shared<dtensor::ColwiseParallel>());
         return at::Tensor();
       }},
      {"clip_negative_max_norm",
       [](Ctx& ctx) {
         torch::nn::Linear lin(4, 4);
         {
           torch::NoGradGuard no_grad;
           lin->weight.copy_(at::arange(16.0).view({4, 4}) / 10);
           lin->bias.zero_();
         }
         dtensor::fully_shard(*lin, dtensor::FullyShardOptions().mesh(mesh1(ctx)));
         lin->forward(ones({2, 4})).sum().backward();
         dtensor::clip_grad_norm_(lin->parameters(), -1.0);
         return lin->weight.grad();
       }},
      {"state_dict_missing_key",
       [](Ctx& ctx) {
         auto lin = sharded_linear(ctx);
         dtensor::StateDict sd;
         sd.insert("weight", ones({4, 4}));
         dtensor::set_model_state_dict(*lin, sd, dtensor::StateDictOptions().full_state_dict(true));
         return at::Tensor();
       }},
      {"state_dict_wrong_shape",
       [](Ctx& ctx) {
         auto lin = sharded_linear(ctx);
         dtensor::StateDict sd;
         sd.insert("weight", ones({4, 5}));
         sd.insert("bias", ones({4}));
         dtensor::set_model_state_dict(*lin, sd, dtensor::StateDictOptions().full_state_dict(true));
         return at::Tensor();
       }},
      {"mesh_larger_than_world",
       [](Ctx& ctx) {
         dtensor::init_device_mesh(c10::kCPU, {ctx.world + 1});
         return at::Tensor();
       }},
      {"partial_to_partial_max",
       [](Ctx& ctx) {
         auto d = DTensor::from_local(ones({4}) * static_cast<double>(ctx.rank + 1), mesh1(ctx),
                                      {Placement::partial()});
         return d.redistribute(mesh1(ctx), {Placement::partial(dtensor::ReduceOp::Max)});
       }},
      {"fully_shard_scalar_param",
       [](Ctx& ctx) {
         auto m = std::make_shared<torch::nn::Module>();
         m->register_parameter("scale", at::scalar_tensor(2.0));
         dtensor::fully_shard(*m, dtensor::FullyShardOptions().mesh(mesh1(ctx)));
         return at::Tensor();
       }},
      {"fully_shard_module_on_stack",
       [](Ctx& ctx) {
         torch::nn::Module m; // C++ only: PyTorch modules are always heap objects
         m.register_parameter("w", at::ones({4}));
         dtensor::fully_shard(m, dtensor::FullyShardOptions().mesh(mesh1(ctx)));
         return at::Tensor();
       }},
      {"parallelize_no_match",
       [](Ctx& ctx) {
         torch::nn::Sequential m(torch::nn::Linear(4, 4));
         dtensor::parallelize_module(*m, mesh1(ctx),
                                     {{"missing", std::make_shared<dtensor::ColwiseParallel>()}});
         return at::Tensor();
       }},
      {"cat_different_meshes",
       [](Ctx& ctx) {
         auto a = dtensor::distribute_tensor(ones({4, 4}), mesh1(ctx), {Placement::replicate()});
         auto b = dtensor::distribute_tensor(ones({4, 4}), mesh_y(ctx), {Placement::replicate()});
         return at::cat({a, b});
       }},
  };
  return table;
}

void run(Ctx& ctx) {
  for (const Case& c : ctx.cases) {
    const std::string name = c.str("key");
    auto it = cases().find(name);
    TORCH_CHECK(it != cases().end(), "misuse case ", name, " has no C++ side");
    try {
      at::Tensor out = it->second(ctx);
      if (out.defined()) {
        ctx.results.tensor(name + "#0", out);
      } else {
        ctx.results.value(name + "#0", std::string("ok"));
      }
    } catch (const std::exception& e) {
      ctx.results.error(name + "#0", e);
    }
  }
}

[[maybe_unused]] const bool registered = register_scenario("misuse", run);

} // namespace
} // namespace conformance::sc_misuse
