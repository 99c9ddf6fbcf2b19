// Float8's all-gather for fully_shard (float8_all_gather.h), and
// precompute_float8_dynamic_scale_for_fsdp (include/dtensor/float8.h).
#include "parallel/float8/float8_all_gather.h"

#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <dtensor/float8.h>

#include "mesh/collectives_internal.h"
#include "parallel/float8/float8_cast.h"

namespace dtensor::detail {

// [Note: float8 all-gather] torchao's float8 all-gather for FSDP2, as one all-gather extension
// of fully_shard ([Note: the all-gather extension] in lib/parallel/fsdp/all_gather_extension.cpp).
// A converted weight's shard is cast to e4m3 with one scale for the whole weight (max(e4m3) /
// the amax of every rank's shard: one MAX all-reduce over the shard group for every float8
// weight of the unit, in prepare, or precompute_float8_dynamic_scale_for_fsdp's) and gathered
// as bytes: one byte an element where bf16 takes two. As torchao's unsharded weight is the
// gathered float8 data, the unit keeps the gathered bits as the weight (keeps_gathered): one
// byte an element while it is unsharded, where a rebuilt bf16 weight takes two and its cast
// in each product one more. The float8 linear's products read the bits (float8_mm_kept); its
// gradient goes to the parameter as any op's does, so the gradient's reduce-scatter and the
// optimizer see the ordinary parameter. Any other op on the weight gets x8 / scale in the
// parameter dtype, made for it. Where the unit rebuilds instead (an int reshard_after_forward)
// the dequantized x8 / scale is the unsharded parameter and the linear casts it again with the
// same scale: x8 / scale * scale is within an fp32 (or bf16) rounding of x8, which e4m3's 3
// mantissa bits round back to x8, so the products see exactly the gathered bits either way.
// As in torchao the cast is from the sharded (master) values; unlike torchao#3982, uneven and
// empty shards (an empty shard's amax is 0) are ordinary. A scale stays valid from its
// computation until the unit's backward ends: forward and backward gather the same bits.

namespace {

class Float8AllGather final : public AllGatherExtension {
 public:
  explicit Float8AllGather(std::string linear) : linear_(std::move(linear)) {}

  std::string name() const override { return "float8 (" + linear_ + ")"; }

  void
  prepare(const std::vector<std::pair<AllGatherExtension*, AllGatherParam>>& same_type) override {
    std::vector<std::pair<Float8AllGather*, at::Tensor>> stale;
    for (const auto& [extension, param] : same_type) {
      auto* f = static_cast<Float8AllGather*>(extension);
      if (!f->valid_) {
        stale.emplace_back(f, param.local);
      }
    }
    if (!stale.empty()) {
      compute_scales(stale, same_type.front().second.shard_group);
    }
  }

  AllGatherInputs pre_all_gather(const AllGatherParam& param) override {
    return {{float8_cast(param.padded, scale_, at::kFloat8_e4m3fn)}, nullptr};
  }

  at::Tensor post_all_gather(const std::vector<at::Tensor>& gathered, const AllGatherInputs&,
                             const AllGatherParam&) override {
    return gathered.at(0).to(at::kFloat) / scale_;
  }

  void after_backward() override { valid_ = false; }

  bool keeps_gathered() const override { return true; }

  at::Tensor unsharded_value(const std::vector<at::Tensor>& kept,
                             const AllGatherParam& param) override {
    return (kept.at(0).to(at::kFloat) / scale_).to(param.param_dtype);
  }

  const at::Tensor& scale() const { return scale_; }

  // Every weight's scale from one MAX all-reduce of its shard's amax over `shard_group` (their
  // shard group); an empty shard contributes 0.
  static void compute_scales(const std::vector<std::pair<Float8AllGather*, at::Tensor>>& weights,
                             const Group& shard_group) {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> amax;
    for (const auto& [f, local] : weights) {
      amax.push_back(local.numel() > 0 ? local.abs().max().to(at::kFloat)
                                       : at::zeros({}, local.options().dtype(at::kFloat)));
    }
    at::Tensor all = at::stack(amax);
    dtensor::all_reduce_(all, ReduceOp::Max, shard_group, detail::known_sizes());
    for (size_t k = 0; k < weights.size(); ++k) {
      Float8AllGather* f = weights[k].first;
      f->scale_ = float8_amax_to_scale(all[static_cast<int64_t>(k)], at::kFloat8_e4m3fn, false);
      f->valid_ = true;
    }
  }

 private:
  std::string linear_;
  at::Tensor scale_;
  bool valid_ = false;
};

} // namespace

std::shared_ptr<AllGatherExtension> float8_all_gather_extension(const std::string& name) {
  return std::make_shared<Float8AllGather>(name);
}

at::Tensor float8_all_gather_scale(const at::Tensor& weight) {
  const auto f = std::dynamic_pointer_cast<Float8AllGather>(all_gather_extension(weight));
  return f ? f->scale() : at::Tensor();
}

bool float8_weight_kept(const at::Tensor& weight) {
  return !gathered_unsharded(weight).empty();
}

} // namespace dtensor::detail

namespace dtensor {

void precompute_float8_dynamic_scale_for_fsdp(torch::nn::Module& module) {
  // The float8 weights under `module`, by shard group: one all-reduce each.
  std::vector<std::pair<Group, std::vector<std::pair<detail::Float8AllGather*, at::Tensor>>>>
      by_group;
  for (const auto& [extension, param] : all_gather_params(module)) {
    auto* f = dynamic_cast<detail::Float8AllGather*>(extension.get());
    if (f == nullptr) {
      continue;
    }
    auto it = std::find_if(by_group.begin(), by_group.end(),
                           [&](const auto& g) { return g.first == param.shard_group; });
    if (it == by_group.end()) {
      by_group.emplace_back(param.shard_group,
                            std::vector<std::pair<detail::Float8AllGather*, at::Tensor>>());
      it = std::prev(by_group.end());
    }
    it->second.emplace_back(f, param.local);
  }
  for (const auto& [group, weights] : by_group) {
    detail::Float8AllGather::compute_scales(weights, group);
  }
}

} // namespace dtensor
