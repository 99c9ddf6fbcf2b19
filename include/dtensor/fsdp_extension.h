#pragma once
// fully_shard's all-gather extension, the C++ shape of FSDP2's fsdp_pre_all_gather /
// fsdp_post_all_gather: a parameter may say what its unit's all-gather sends for its shard and
// how the unsharded parameter is rebuilt from what every rank sent. fully_shard knows no
// format: float8's all-gather (Float8LinearOptions::enable_fsdp_float8_all_gather) is one
// extension, and any other (an int8 or a bf16-compressed gather) plugs in the same way
// ([Note: the all-gather extension] in lib/parallel/fsdp/all_gather_extension.cpp).
//
//   set_all_gather_extension(model->proj->weight, std::make_shared<MyInt8AllGather>());
//   dtensor::fully_shard(*model);   // the unit takes the extension with the parameter
//
// The unit still issues one all-gather: every parameter's tensors travel as bytes in one
// buffer, each piece 16-byte aligned.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <dtensor/process_group.h>

namespace dtensor {

// One parameter's all-gather as its unit describes it to the extension.
struct AllGatherParam {
  std::string name; // the parameter's name under its unit's module
  // This rank's rows of the sharded parameter (its stored values and dtype; possibly empty).
  at::Tensor local;
  // The same rows padded with zero rows to the chunk every rank sends: the same shape on every
  // rank (rows along dim `shard_dim`). What pre_all_gather encodes.
  at::Tensor padded;
  int64_t shard_dim = 0;
  int64_t shard_size = 1;                   // ranks in the shard group
  std::vector<int64_t> unsharded_shape;     // the whole parameter's
  c10::ScalarType param_dtype = at::kFloat; // the unsharded parameter's (mixed precision's)
  Group shard_group;                        // the ranks the unit gathers over
};

// What pre_all_gather gives the unit: the tensors to send, and what post_all_gather needs back.
struct AllGatherInputs {
  // Any dtypes and shapes, but, for a given `padded` shape, the same on every rank: the unit
  // sends them in one all-gather whose size every rank computes on its own.
  std::vector<at::Tensor> tensors;
  std::shared_ptr<void> metadata;
};

class AllGatherExtension {
 public:
  virtual ~AllGatherExtension() = default;
  // Named in errors.
  virtual std::string name() const = 0;
  // Once per all-gather of a unit, on every rank, before any pre_all_gather: every parameter
  // of the unit whose extension has this one's type (this is the first's), with its
  // extension. One collective over their shard group can serve them all (float8's amaxes).
  virtual void
  prepare(const std::vector<std::pair<AllGatherExtension*, AllGatherParam>>& same_type) {
    (void)same_type;
  }
  // What to send for `param`'s shard.
  virtual AllGatherInputs pre_all_gather(const AllGatherParam& param) = 0;
  // `gathered[i]` is every rank's `sent.tensors[i]`, stacked along a new dim 0 in shard-group
  // rank order ([shard_size, *shape]). Returns every rank's `padded` rebuilt, stacked the same
  // way ([shard_size, *padded's shape], a floating dtype): the unit keeps each rank's own rows
  // and casts them to param_dtype into the unsharded parameter, which autograd, the gradient's
  // reduce-scatter and everything else see as usual.
  virtual at::Tensor post_all_gather(const std::vector<at::Tensor>& gathered,
                                     const AllGatherInputs& sent, const AllGatherParam& param) = 0;
  // The unit's backward ended: an optimizer step may change the shard before the next gather.
  virtual void after_backward() {}

  // Optional: the unsharded parameter kept as what was gathered (FSDP2's unsharded tensor
  // subclass over its all-gather outputs; torchao's float8 weight is its gathered bytes).
  // When true, every tensor pre_all_gather sends has `padded`'s rows along shard_dim (and its
  // number of dims); the unit keeps every rank's own rows of each, whole (the sent shape with
  // the parameter's rows, the sent dtype), frees them when it reshards, and never rebuilds the
  // parameter in param_dtype. The extension's own consumer reads them with
  // gathered_unsharded(), inside an autograd function that takes the parameter itself as an
  // input (its gradient then reaches the parameter as any op's does); any other op of forward
  // or backward on the parameter runs on unsharded_value(kept), made for that use. A unit
  // resharding after forward to a smaller group (an int reshard_after_forward) rebuilds with
  // post_all_gather instead.
  virtual bool keeps_gathered() const { return false; }
  // With keeps_gathered: the parameter's value ([unsharded_shape], param_dtype) from the kept
  // tensors. The default refuses, naming the extension.
  virtual at::Tensor unsharded_value(const std::vector<at::Tensor>& kept,
                                     const AllGatherParam& param);
};

// The tensors fully_shard keeps as `param`'s unsharded value when its extension keeps what was
// gathered (keeps_gathered), one per tensor it sends, its unit unsharded first if it is not (as
// for any op of forward or backward). Empty when `param` is not kept so (a plain parameter, no
// such extension, an int reshard_after_forward).
std::vector<at::Tensor> gathered_unsharded(const at::Tensor& param);

// `param`, a module's parameter that fully_shard does not manage yet, is to be gathered by
// `extension` in the unit that takes it (null: by nothing). Kept while the parameter lives.
// A parameter fully_shard manages already is refused.
void set_all_gather_extension(const at::Tensor& param,
                              std::shared_ptr<AllGatherExtension> extension);
// The extension of `param`: registered on a plain parameter, or held by the unit of a
// fully_shard one; null when none.
std::shared_ptr<AllGatherExtension> all_gather_extension(const at::Tensor& param);
// Every fully_shard parameter under `module` with an extension, with the description its
// next all-gather gives it (for steps such as precompute_float8_dynamic_scale_for_fsdp that
// serve several at once), in module order.
std::vector<std::pair<std::shared_ptr<AllGatherExtension>, AllGatherParam>>
all_gather_params(torch::nn::Module& module);

} // namespace dtensor
