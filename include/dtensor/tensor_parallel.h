#pragma once

// Tensor parallelism on unmodified torch::nn modules: parallel styles and
// parallelize_module, after torch.distributed.tensor.parallel. Mechanism, layouts and the
// plan syntax: docs/tensor_parallel.md.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <dtensor/device_mesh.h>
#include <dtensor/placement.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor {

// How a module's parameters are distributed over the 1-D tensor-parallel mesh and how its
// inputs and outputs are laid out. Subclasses below; apply() is called by
// parallelize_module.
class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  virtual std::string name() const = 0;
  virtual void apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const = 0;
  // Whether the style acts only where the module is called through dtensor::call (context
  // and expert parallelism): parallelize_module then refuses a module that a
  // torch::nn::Sequential calls, which would bypass it. Tensor parallelism's styles also
  // work when the module's forward is called directly.
  virtual bool needs_module_calls() const { return false; }
};

// Linear: weight and bias Shard(0) (output features); Embedding: weight Shard(1).
// Input: input_layouts (default Replicate) redistributed to Replicate; output
// output_layouts (default Shard(-1)).
class ColwiseParallel : public ParallelStyle {
 public:
  TORCH_ARG(Placement, input_layouts) = Placement::replicate();
  TORCH_ARG(Placement, output_layouts) = Placement::shard(-1);
  // [Note: local outputs] true (PyTorch's default) asks for the output as a plain local
  // tensor. That changes the shape autograd recorded, which only a module hook could do;
  // outputs stay DTensors in output_layouts and are converted to plain tensors by
  // to_local() / full_tensor() where the caller needs them. Accepted either way.
  TORCH_ARG(bool, use_local_output) = true;
  std::string name() const override { return "ColwiseParallel"; }
  void apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const override;
};

// Linear: weight Shard(1) (input features), bias Replicate; Embedding: weight Shard(0).
// Input: input_layouts (default Shard(-1)); output: output_layouts (default Replicate: one
// all-reduce; Shard(d): one reduce-scatter).
class RowwiseParallel : public ParallelStyle {
 public:
  TORCH_ARG(Placement, input_layouts) = Placement::shard(-1);
  TORCH_ARG(Placement, output_layouts) = Placement::replicate();
  TORCH_ARG(bool, use_local_output) = true; // see [Note: local outputs]
  std::string name() const override { return "RowwiseParallel"; }
  void apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const override;
};

// LayerNorm / RMSNorm-like modules (and Dropout) computing on sequence shards: parameters
// Replicate; input redistributed to Shard(sequence_dim); output stays Shard(sequence_dim).
class SequenceParallel : public ParallelStyle {
 public:
  explicit SequenceParallel(int64_t sequence_dim = 1) : sequence_dim_(sequence_dim) {}
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(bool, use_local_output) = false;
  std::string name() const override { return "SequenceParallel"; }
  void apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const override;
};

// Only the input layouts of a module. Called through dtensor::call (the module seam), the
// style's hooks convert the module's first tensor input from input_layouts to
// desired_input_layouts, and its later tensor inputs per more_input_layouts ([Note: tensor
// parallelism on the module seam]). Called as module->forward(...): on a module whose own
// parameters another style parallelized, the first op that uses those parameters converts
// its input; on any other module (torchtitan's attention / feed_forward) nothing does unless
// its forward calls prepare_module_input ([Note: module inputs without hooks]).
class PrepareModuleInput : public ParallelStyle {
 public:
  TORCH_ARG(Placement, input_layouts) = Placement::replicate();
  TORCH_ARG(Placement, desired_input_layouts) = Placement::replicate();
  TORCH_ARG(bool, use_local_output) = false;
  // The layouts of the second and later tensor inputs (PyTorch's input_layouts tuple after
  // its first element): a plain input is taken as this rank's piece in it (Replicate: the
  // whole tensor, the same on every rank, e.g. a rotary table), a DTensor is redistributed
  // to it; nullopt, or past the end: left alone.
  TORCH_ARG(std::vector<std::optional<Placement>>, more_input_layouts) = {};
  std::string name() const override { return "PrepareModuleInput"; }
  void apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const override;
};

// [Note: module inputs without hooks] What the module seam's tensor-parallel pre-forward
// hook does to a module's first input, for code that calls module->forward(...) directly: a
// DTensor is redistributed from its placements to desired_input_layouts, a plain tensor is
// first taken as this rank's piece in input_layouts (DTensor::from_local); both
// differentiable, so the gradient takes the reverse path (all-gather forward, reduce-scatter
// backward for Shard(1) -> Replicate). With use_local_output the local tensor is returned.
// On a module whose own parameters a style parallelized (a ColwiseParallel Linear with
// input_layouts Shard(1)), a DTensor input is redistributed to the style's desired input
// layout, above autograd: the ops would convert it as well, but below autograd, so its
// gradient would come back Partial and every backward op using it would reduce it again.
// `input` is returned unchanged where no style applies to `module`.
at::Tensor prepare_module_input(const torch::nn::Module& module, const at::Tensor& input);

// Only the output layout: the module's outputs are redistributed from output_layouts to
// desired_output_layouts when they leave the module. On a module whose parameters no style
// parallelized (a mixture-of-experts layer computing on local rows), a plain output is first
// taken as this rank's piece in output_layouts (DTensor::from_local), as PyTorch's does.
class PrepareModuleOutput : public ParallelStyle {
 public:
  TORCH_ARG(Placement, output_layouts) = Placement::replicate();
  TORCH_ARG(Placement, desired_output_layouts) = Placement::replicate();
  TORCH_ARG(bool, use_local_output) = true; // see [Note: local outputs]
  std::string name() const override { return "PrepareModuleOutput"; }
  void apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const override;
};

// Module path pattern -> style. Patterns are dotted paths whose atoms match like fnmatch
// ("layers.*.attention.wq", "mlp.w[12]"); applied in order. Styles are taken by value, as
// PyTorch's plan dict holds them: {{"w1", ColwiseParallel()}, {"w2", RowwiseParallel()}}
// (a shared pointer to a style is accepted too).
struct ParallelizePlanEntry {
  template <typename Style,
            typename = std::enable_if_t<std::is_base_of_v<ParallelStyle, std::decay_t<Style>>>>
  ParallelizePlanEntry(std::string path, Style s) // NOLINT(google-explicit-constructor)
      : pattern(std::move(path)), style(std::make_shared<const std::decay_t<Style>>(std::move(s))) {
  }
  ParallelizePlanEntry(std::string path, std::shared_ptr<const ParallelStyle> s)
      : pattern(std::move(path)), style(std::move(s)) {}
  std::string pattern;
  std::shared_ptr<const ParallelStyle> style;
};
using ParallelizePlan = std::vector<ParallelizePlanEntry>;

// Applies `style` to `module` itself, or every plan entry to the submodules its pattern
// matches. Errors: a pattern matching no submodule, a style on a module type it does not
// support, a mesh that is not 1-D. Collective: every rank of tp_mesh calls it alike
// (parameters are distributed from the mesh's first rank).
void parallelize_module(torch::nn::Module& module, const DeviceMesh& tp_mesh,
                        const ParallelStyle& style);
void parallelize_module(torch::nn::Module& module, const DeviceMesh& tp_mesh,
                        const std::shared_ptr<const ParallelStyle>& style);
void parallelize_module(torch::nn::Module& module, const DeviceMesh& tp_mesh,
                        const ParallelizePlan& plan);

// distribute_module, after torch.distributed.tensor.distribute_module: for every submodule
// (named_modules order) partition_fn(name, submodule, mesh) may turn its parameters into
// DTensors (param.set_data(distribute_tensor(...))); every parameter and buffer left plain is
// then replicated over `mesh`. Without partition_fn everything is replicated. PyTorch's
// input_fn / output_fn are module hooks, which C++ modules lack: convert inputs with
// distribute_tensor / DTensor::from_local and outputs with to_local / full_tensor. The
// result composes with fully_shard on another dimension of the same root mesh.
using PartitionFn =
    std::function<void(const std::string& name, torch::nn::Module& module, const DeviceMesh& mesh)>;
void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const PartitionFn& partition_fn = nullptr);

// Loss parallelism, after torch.distributed.tensor.parallel.loss_parallel: while a
// LossParallel lives (in any thread: the autograd engine's included), cross-entropy --
// torch::nn::functional::cross_entropy, i.e. log_softmax + nll_loss -- on logits [N, C]
// (or [C]) whose class dim is Shard on exactly one mesh dim runs on the local shards, and
// the logits are never gathered. Forward: two all-reduces of N elements for the
// log-softmax (row max, row sum of exponentials) and one of a scalar for the loss (N
// elements with reduction none); backward: none. Other mesh dims may shard the batch (a
// DTensor target then carries the same layout) or replicate. Differences from PyTorch
// (docs/tensor_parallel.md "Loss parallelism"): reduction mean on a batch-sharded mesh is
// the global mean (one more scalar all-reduce per batch mesh dim; PyTorch refuses it), and
// the gradient stays right when the log-probabilities also feed something besides nll_loss.
class LossParallel {
 public:
  LossParallel();
  ~LossParallel();
  LossParallel(const LossParallel&) = delete;
  LossParallel& operator=(const LossParallel&) = delete;
};
bool loss_parallel_enabled();

} // namespace dtensor
