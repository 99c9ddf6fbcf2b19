// Float8 linear layers (include/dtensor/float8.h, docs/float8.md): torchao's Float8Linear
// numerics, its recipes, and the conversion of a model's Linears on the module seam.
#include <dtensor/float8.h>

#include <ATen/ATen.h>

#include <dtensor/dtensor.h>
#include <dtensor/user_rules.h>

#include "internal/check.h"
#include "parallel/float8/float8_all_gather.h"
#include "parallel/float8/float8_mm.h"
#include "parallel/module_ptr.h"

namespace dtensor {

namespace {

at::Tensor float8_linear_plain(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& weight_scale,
                               Float8Recipe recipe) {
  at::Tensor y = detail::float8_mm(x, weight, weight_scale, recipe, {});
  return bias.defined() ? y + bias.to(y.scalar_type()) : y;
}

} // namespace

Float8Recipe float8_recipe_from_name(const std::string& name) {
  for (Float8Recipe r :
       {Float8Recipe::Tensorwise, Float8Recipe::Rowwise, Float8Recipe::RowwiseWithGwHp}) {
    if (name == name_of(r)) {
      return r;
    }
  }
  DTENSOR_FAIL("float8: unknown recipe '{}' (valid: tensorwise, rowwise, rowwise_with_gw_hp)",
               name);
}

const char* name_of(Float8Recipe recipe) {
  switch (recipe) {
  case Float8Recipe::Tensorwise:
    return "tensorwise";
  case Float8Recipe::Rowwise:
    return "rowwise";
  case Float8Recipe::RowwiseWithGwHp:
    return "rowwise_with_gw_hp";
  }
  return "?";
}

at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                         const Float8LinearOptions& options) {
  DTENSOR_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1),
                "float8_linear: input {} does not fit weight {} (in features last)",
                c10::str(x.sizes()), c10::str(weight.sizes()));
  DTENSOR_CHECK(at::isFloatingType(x.scalar_type()) && at::isFloatingType(weight.scalar_type()),
                "float8_linear: input ({}) and weight ({}) must be floating point",
                c10::toString(x.scalar_type()), c10::toString(weight.scalar_type()));
  const Float8Recipe recipe = options.recipe();
  if (is_dtensor(x) || detail::float8_tp_weight(weight)) {
    return detail::float8_linear_tp(x, weight, bias, recipe);
  }
  if (!is_dtensor(weight) && !(bias.defined() && is_dtensor(bias))) {
    return float8_linear_plain(x, weight, bias, at::Tensor(), recipe);
  }
  // Gathered in float8 by fully_shard: the products read the bits its unit keeps, or, where
  // the unit rebuilt the weight in high precision, cast it again with the same scale.
  const at::Tensor scale = detail::float8_all_gather_scale(weight);
  if (scale.defined() && detail::float8_weight_kept(weight)) {
    const at::Tensor y = detail::float8_mm_kept(x, weight, scale, recipe);
    return bias.defined() ? y + bias.to(y.scalar_type()) : y;
  }
  // A fully_shard parameter: inside local_map, its local value is the unit's unsharded value
  // ([Note: local regions] in lib/tensor/dispatch/interceptors.h).
  const LocalFn local = local_map(
      [recipe, scale](const std::vector<at::Tensor>& t) -> std::vector<at::Tensor> {
        return {float8_linear_plain(t[0], t[1], t.size() > 2 ? t[2] : at::Tensor(), scale, recipe)};
      },
      LocalMapOptions().out_placements({std::nullopt}));
  return bias.defined() ? local({x, weight, bias})[0] : local({x, weight})[0];
}

at::Tensor float8_grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts) {
  DTENSOR_CHECK(!is_dtensor(x) && !is_dtensor(w),
                "float8_grouped_mm: takes plain tensors (call it inside dtensor::local_map)");
  DTENSOR_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2) && counts.dim() == 1 &&
                    counts.size(0) == w.size(0),
                "float8_grouped_mm: rows {} do not fit experts {} with counts {} (x [N, in], w "
                "[E, out, in], counts [E])",
                c10::str(x.sizes()), c10::str(w.sizes()), c10::str(counts.sizes()));
  DTENSOR_CHECK(at::isFloatingType(x.scalar_type()) && x.scalar_type() == w.scalar_type(),
                "float8_grouped_mm: rows ({}) and experts ({}) must share a floating dtype",
                c10::toString(x.scalar_type()), c10::toString(w.scalar_type()));
  const int64_t rows = counts.sum().item<int64_t>();
  DTENSOR_CHECK(rows <= x.size(0) && counts.min().item<int64_t>() >= 0,
                "float8_grouped_mm: counts {} add up to {} rows, x has {}",
                c10::str(counts.sizes()), rows, x.size(0));
  return detail::float8_grouped_mm_local(x, w, counts);
}

bool float8_skip_output_and_unaligned(const std::string& name,
                                      const torch::nn::LinearImpl& linear) {
  const bool output = name == "output" || (name.size() > 7 && name.ends_with(".output"));
  return !output && linear.options.in_features() % 16 == 0 &&
         linear.options.out_features() % 16 == 0;
}

namespace {

// A Linear named in messages: its qualified name, or the module passed itself.
std::string linear_label(const std::string& key) {
  return key.empty() ? std::string("(the module passed)") : fmt::format("'{}'", key);
}

// The Linears under `owner` that `filter` accepts, each checked before any is converted:
// nothing is half-converted by a refusal.
std::vector<std::pair<std::string, torch::nn::LinearImpl*>>
float8_targets(torch::nn::Module& owner, const Float8LinearOptions& options,
               const Float8Filter& filter) {
  std::vector<std::pair<std::string, torch::nn::LinearImpl*>> targets;
  for (const auto& item : owner.named_modules()) {
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
    if (linear == nullptr || (filter && !filter(item.key(), *linear))) {
      continue;
    }
    DTENSOR_CHECK(!options.enable_fsdp_float8_all_gather() ||
                      options.recipe() == Float8Recipe::Tensorwise,
                  "convert_to_float8_training: Linear {}: fully_shard's float8 all-gather "
                  "needs the tensorwise recipe (one scale per weight), got {}",
                  linear_label(item.key()), name_of(options.recipe()));
    DTENSOR_CHECK(!options.enable_fsdp_float8_all_gather() || !is_dtensor(linear->weight),
                  "convert_to_float8_training: Linear {}: its weight is a DTensor already; with "
                  "enable_fsdp_float8_all_gather convert before fully_shard (and without tensor "
                  "parallelism)",
                  linear_label(item.key()));
    for (const std::string& hook : module_hook_names(*linear)) {
      DTENSOR_CHECK(hook.rfind("Float8Linear", 0) != 0,
                    "convert_to_float8_training: Linear {} is converted already ({})",
                    linear_label(item.key()), hook);
    }
    targets.emplace_back(item.key(), linear);
  }
  // [Note: children of a Sequential] (lib/parallel/module_ptr.h): a Sequential would call
  // these Linears' forward itself, in high precision.
  std::vector<std::string> bypassed;
  for (const std::string& name : detail::sequential_children(owner)) {
    for (const auto& t : targets) {
      if (t.first == name) {
        bypassed.push_back(name);
      }
    }
  }
  DTENSOR_CHECK(bypassed.empty(),
                "convert_to_float8_training: Linears [{}] are called by a torch::nn::Sequential, "
                "whose forward calls them directly, bypassing dtensor::call: they would compute "
                "in high precision. Call them through dtensor::call from a module's forward, or "
                "leave them out with the filter",
                fmt::join(bypassed, ", "));
  return targets;
}

} // namespace

std::vector<std::string> convert_to_float8_training(torch::nn::Module& module,
                                                    const Float8LinearOptions& options,
                                                    const Float8Filter& filter) {
  const auto owner = detail::owned_module(module, "convert_to_float8_training");
  std::vector<std::string> converted;
  for (const auto& [name, linear] : float8_targets(*owner, options, filter)) {
    if (options.enable_fsdp_float8_all_gather()) {
      set_all_gather_extension(linear->weight, detail::float8_all_gather_extension(name));
    }
    register_module_hooks(
        *linear, ModuleHooks()
                     .name(fmt::format("Float8Linear({})", name_of(options.recipe())))
                     .order(hook_order::kFloat8)
                     .around_forward([options](torch::nn::Module& m, const TensorList& inputs,
                                               const ForwardFn&) -> TensorList {
                       auto& l = static_cast<torch::nn::LinearImpl&>(m);
                       return {float8_linear(inputs.at(0), l.weight, l.bias, options)};
                     }));
    converted.push_back(name);
  }
  return converted;
}

} // namespace dtensor
