#pragma once

// Float8 for mixture-of-experts layers, applied from outside the model as torchtitan's
// converters are ([Note: models carry no parallelism] in models/llama3/model.h): the routed
// experts' three grouped products in float8 rowwise (torchtitan's
// Float8GroupedExpertsConverter over torchao's fp8_grouped_mm; dtensor::float8_grouped_mm).
// The router's gate stays in fp32 and the shared experts are Linears
// (dtensor::convert_to_float8_training converts them). docs/float8.md, "Mixture of experts".
#include <string>
#include <vector>

#include <dtensor/float8.h>
#include <dtensor/module_hooks.h>
#include <dtensor/user_rules.h>

#include <models/moe/moe.h>

namespace dtensor::models {

// Every GroupedExperts under `model` whose dims allow it (dim and hidden dim multiples of 16,
// what float8 kernels need) computes SwiGLU w2(silu(w1 x) * w3 x) with float8_grouped_mm, on
// its local experts under expert parallelism (the hook runs inside ExpertParallel's dispatch,
// on the same local region as the experts' own forward). Returns the converted modules' names
// in module order; one converted twice is refused by name.
inline std::vector<std::string> convert_grouped_experts_to_float8(torch::nn::Module& model) {
  std::vector<std::string> converted;
  for (const auto& item : model.named_modules()) {
    auto* experts = dynamic_cast<GroupedExpertsImpl*>(item.value().get());
    if (experts == nullptr || experts->w1.size(1) % 16 != 0 || experts->w1.size(2) % 16 != 0) {
      continue;
    }
    for (const std::string& hook : module_hook_names(*experts)) {
      DTENSOR_MODEL_CHECK(hook != "Float8GroupedExperts(rowwise)",
                          "convert_grouped_experts_to_float8: '", item.key(),
                          "' is converted already");
    }
    register_module_hooks(
        *experts, ModuleHooks()
                      .name("Float8GroupedExperts(rowwise)")
                      .order(hook_order::kFloat8)
                      .around_forward([](torch::nn::Module& m, const TensorList& in,
                                         const ForwardFn&) -> TensorList {
                        auto& e = static_cast<GroupedExpertsImpl&>(m);
                        static const LocalFn local = local_map(
                            [](const std::vector<at::Tensor>& t) -> std::vector<at::Tensor> {
                              const at::Tensor h = at::silu(float8_grouped_mm(t[0], t[2], t[1])) *
                                                   float8_grouped_mm(t[0], t[4], t[1]);
                              return {float8_grouped_mm(h, t[3], t[1])};
                            },
                            LocalMapOptions().out_placements({std::nullopt}));
                        return {local({in.at(0), in.at(1), e.w1, e.w2, e.w3})[0]};
                      }));
    converted.push_back(item.key());
  }
  return converted;
}

} // namespace dtensor::models
