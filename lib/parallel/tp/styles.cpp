// Parallel styles and parallelize_module.
#include <dtensor/tensor_parallel.h>

#include <fnmatch.h>

#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <dtensor/dtensor.h>
#include <dtensor/module_hooks.h>

#include "internal/check.h"
#include "parallel/module_ptr.h"
#include "parallel/tp/tensor_parallel.h"
#include "tensor/dtensor_impl.h"

namespace dtensor {

namespace {

using detail::TpTag;

struct Layouts {
  std::optional<Placement> input, desired_input, output;
  bool local_output = false;
};

// State kept per module by address, without hooks: the weak pointer tells a live module from a
// new one at a freed module's address (an entry of a freed module is dropped when met).
template <class Value>
class ModuleRegistry {
 public:
  void set(const torch::nn::Module& module, std::weak_ptr<const torch::nn::Module> owner,
           Value value) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_[&module] = {std::move(owner), std::move(value)};
  }
  std::optional<Value> get(const torch::nn::Module& module) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(&module);
    if (it == entries_.end()) {
      return std::nullopt;
    }
    if (it->second.first.lock().get() != &module) {
      entries_.erase(it);
      return std::nullopt;
    }
    return it->second.second;
  }

 private:
  std::mutex mutex_;
  std::map<const torch::nn::Module*, std::pair<std::weak_ptr<const torch::nn::Module>, Value>>
      entries_;
};

// The layouts of the modules a Colwise / Rowwise / SequenceParallel style parallelized, for
// prepare_module_input (a module not owned by a shared_ptr is not listed).
ModuleRegistry<std::shared_ptr<detail::TpLayouts>>& module_layouts() {
  static ModuleRegistry<std::shared_ptr<detail::TpLayouts>> r;
  return r;
}

void tp_hook_module(torch::nn::Module& module);

std::shared_ptr<const TpTag> make_tag(torch::nn::Module& module, const std::string& style,
                                      const Layouts& l) {
  auto tag =
      detail::make_tp_tags(&module, style, module.name(),
                           detail::TpLayouts{l.input, l.desired_input, l.output, l.local_output});
  std::weak_ptr<const torch::nn::Module> owner = module.weak_from_this();
  if (!owner.expired()) {
    module_layouts().set(module, std::move(owner), tag->layouts);
    tp_hook_module(module);
  }
  return tag;
}

void check_mesh(const DeviceMesh& mesh, const std::string& style) {
  DTENSOR_CHECK(mesh.defined() && mesh.ndim() == 1,
                "{}: the tensor-parallel mesh must be 1-D, got {}", style,
                mesh.defined() ? mesh.to_string() : "an undefined mesh");
}

// Distributes `param` in place (same tensor) and tags it.
void distribute_param(at::Tensor& param, const DeviceMesh& mesh, const Placement& placement,
                      const std::shared_ptr<const TpTag>& tag, const std::string& where) {
  DTENSOR_CHECK(!is_dtensor(param), "{}: parameter '{}' is already a DTensor", tag->style, where);
  at::NoGradGuard no_grad;
  at::Tensor dt = distribute_tensor(param.detach(), mesh, {placement});
  detail::set_tp_tag(dt, tag);
  detail::replace_data(param, dt);
  if (param.requires_grad()) {
    // [Note: local outputs] in lib/parallel/tp/tp_dispatch.cpp: a gradient computed from
    // plain local outputs only (a Rowwise bias) is plain and whole, the same on every rank;
    // the parameter's gradient is its piece of it, as the DTensor PyTorch's to_local
    // backward would give.
    param.register_hook([mesh, placement](const at::Tensor& grad) -> at::Tensor {
      if (!grad.defined() || is_dtensor(grad)) {
        return {};
      }
      return distribute_tensor(grad, mesh, {placement}, /*src_data_rank=*/std::nullopt);
    });
  }
}

// Every direct parameter of `module`, by its registered name.
void distribute_all(torch::nn::Module& module, const DeviceMesh& mesh,
                    const std::function<Placement(const std::string&)>& placement_of,
                    const std::shared_ptr<const TpTag>& tag) {
  for (auto& item : module.named_parameters(/*recurse=*/false)) {
    distribute_param(item.value(), mesh, placement_of(item.key()), tag,
                     module.name() + "." + item.key());
  }
}

[[noreturn]] void unsupported(const std::string& style, const torch::nn::Module& module) {
  DTENSOR_FAIL("{} supports Linear and Embedding modules, got {}", style, module.name());
}

// The layouts of the module's own parameters, which another style must have tagged.
std::vector<std::shared_ptr<detail::TpLayouts>> existing_layouts(torch::nn::Module& module,
                                                                 const std::string& style) {
  std::vector<std::shared_ptr<detail::TpLayouts>> layouts;
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    if (auto t = detail::tp_tag(p.value())) {
      layouts.push_back(t->layouts);
    }
  }
  DTENSOR_CHECK(
      !layouts.empty(),
      "{} on {}: without module hooks it adjusts the layouts of a module whose own parameters "
      "another style has parallelized; apply that style first",
      style, module.name());
  return layouts;
}

} // namespace

void ColwiseParallel::apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const {
  check_mesh(tp_mesh, name());
  auto tag =
      make_tag(module, name(),
               {input_layouts(), Placement::replicate(), output_layouts(), use_local_output()});
  if (dynamic_cast<torch::nn::LinearImpl*>(&module) != nullptr) {
    distribute_all(
        module, tp_mesh, [](const std::string&) { return Placement::shard(0); }, tag);
  } else if (dynamic_cast<torch::nn::EmbeddingImpl*>(&module) != nullptr) {
    distribute_all(
        module, tp_mesh, [](const std::string&) { return Placement::shard(1); }, tag);
  } else {
    unsupported(name(), module);
  }
}

void RowwiseParallel::apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const {
  check_mesh(tp_mesh, name());
  if (dynamic_cast<torch::nn::LinearImpl*>(&module) != nullptr) {
    auto tag =
        make_tag(module, name(),
                 {input_layouts(), Placement::shard(-1), output_layouts(), use_local_output()});
    distribute_all(
        module, tp_mesh,
        [](const std::string& n) {
          return n == "weight" ? Placement::shard(1) : Placement::replicate();
        },
        tag);
  } else if (dynamic_cast<torch::nn::EmbeddingImpl*>(&module) != nullptr) {
    auto tag = make_tag(module, name(),
                        {input_layouts(), std::nullopt, output_layouts(), use_local_output()});
    distribute_all(
        module, tp_mesh, [](const std::string&) { return Placement::shard(0); }, tag);
  } else {
    unsupported(name(), module);
  }
}

void SequenceParallel::apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const {
  check_mesh(tp_mesh, name());
  DTENSOR_CHECK(dynamic_cast<torch::nn::LinearImpl*>(&module) == nullptr &&
                    dynamic_cast<torch::nn::EmbeddingImpl*>(&module) == nullptr,
                "SequenceParallel is for norms and dropout (replicated parameters), got {}",
                module.name());
  const Placement seq = Placement::shard(sequence_dim());
  auto tag = make_tag(module, name(), {seq, seq, seq, use_local_output()});
  distribute_all(
      module, tp_mesh, [](const std::string&) { return Placement::replicate(); }, tag);
}

namespace {

// A Prepare* style on a module without parallelized parameters of its own, applied at the
// module seam: PrepareModuleInput ([Note: module inputs without hooks]: the modules that
// convert their own input) and PrepareModuleOutput (an MoE layer under sequence parallelism:
// its outputs converted by the post-forward hook).
template <class Style>
struct Boundary {
  DeviceMesh mesh;
  Style style;
};
using ModuleInput = Boundary<PrepareModuleInput>;
using ModuleOutput = Boundary<PrepareModuleOutput>;

template <class Style>
ModuleRegistry<Boundary<Style>>& boundaries() {
  static ModuleRegistry<Boundary<Style>> r;
  return r;
}
ModuleRegistry<ModuleInput>& module_inputs() {
  return boundaries<PrepareModuleInput>();
}
ModuleRegistry<ModuleOutput>& module_outputs() {
  return boundaries<PrepareModuleOutput>();
}

// A tensor crossing a module's boundary under a Prepare* style: a plain one taken as this
// rank's piece in `layout`, a DTensor as it is; redistributed to `desired`, local with
// `local`; differentiable.
at::Tensor at_boundary(const torch::nn::Module& module, const at::Tensor& t, const DeviceMesh& mesh,
                       const Placement& layout, const Placement& desired, bool local,
                       const char* style) {
  DTensor d = is_dtensor(t) ? DTensor(t) : DTensor::from_local(t, mesh, {layout});
  DTENSOR_CHECK(d.device_mesh() == mesh, "{}({}): the tensor is on {}, the style's mesh is {}",
                style, module.name(), d.device_mesh().to_string(), mesh.to_string());
  const Placements want{desired.normalized(d.dim())};
  DTensor out = d.placements() == want ? d : d.redistribute(want);
  return local ? out.to_local() : at::Tensor(out);
}

// A plain output taken as this rank's piece in output_layouts, a DTensor as it is;
// redistributed to desired_output_layouts, local with use_local_output; differentiable.
at::Tensor prepare_module_output(const torch::nn::Module& module, const at::Tensor& output) {
  const std::optional<ModuleOutput> entry = module_outputs().get(module);
  if (!entry || !output.defined()) {
    return output;
  }
  const PrepareModuleOutput& style = entry->style;
  return at_boundary(module, output, entry->mesh, style.output_layouts(),
                     style.desired_output_layouts(), style.use_local_output(),
                     "PrepareModuleOutput");
}

bool has_own_tp_parameters(const torch::nn::Module& module) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    if (detail::tp_tag(p.value())) {
      return true;
    }
  }
  return false;
}

// A DTensor input of a module a style parallelized, redistributed above autograd to the
// style's desired input layout (what the ops would otherwise do below it).
at::Tensor to_desired_input(const torch::nn::Module& module, const at::Tensor& input) {
  const auto found = module_layouts().get(module);
  const std::shared_ptr<detail::TpLayouts> layouts = found ? *found : nullptr;
  if (!layouts || !layouts->desired_input || !is_dtensor(input)) {
    return input;
  }
  DTensor d(input);
  if (d.device_mesh().ndim() != 1) {
    return input; // not on a tensor-parallel mesh: the ops report it with the op's name
  }
  const Placements want{layouts->desired_input->normalized(d.dim())};
  return d.placements() == want ? input : at::Tensor(d.redistribute(want));
}

} // namespace

void PrepareModuleInput::apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const {
  check_mesh(tp_mesh, name());
  if (!has_own_tp_parameters(module)) {
    module_inputs().set(module, detail::owned_module(module, "PrepareModuleInput"),
                        ModuleInput{tp_mesh, *this});
    tp_hook_module(module);
    return;
  }
  for (const auto& layouts : existing_layouts(module, name())) {
    layouts->input = input_layouts();
    layouts->desired_input = desired_input_layouts();
  }
}

at::Tensor prepare_module_input(const torch::nn::Module& module, const at::Tensor& input) {
  const std::optional<ModuleInput> entry = module_inputs().get(module);
  if (!input.defined()) {
    return input;
  }
  if (!entry) {
    return to_desired_input(module, input);
  }
  const PrepareModuleInput& style = entry->style;
  return at_boundary(module, input, entry->mesh, style.input_layouts(),
                     style.desired_input_layouts(), style.use_local_output(),
                     "prepare_module_input");
}

namespace {

// PrepareModuleInput's more_input_layouts: a plain input taken as this rank's piece in its
// layout (Replicate: the whole tensor, so no sizes to agree on), a DTensor redistributed.
void tp_more_inputs(const torch::nn::Module& module, TensorList& inputs) {
  const std::optional<ModuleInput> entry = module_inputs().get(module);
  if (!entry) {
    return;
  }
  const auto& layouts = entry->style.more_input_layouts();
  for (size_t k = 1; k < inputs.size() && k - 1 < layouts.size(); ++k) {
    const std::optional<Placement>& layout = layouts[k - 1];
    at::Tensor& t = inputs[k];
    if (!layout || !t.defined()) {
      continue;
    }
    if (is_dtensor(t)) {
      DTensor d(t);
      const Placements want{layout->normalized(d.dim())};
      t = d.placements() == want ? t : at::Tensor(d.redistribute(want));
    } else if (layout->is_replicate()) {
      t = DTensor::from_local(t, entry->mesh, {*layout}, t.sizes().vec());
    } else {
      t = DTensor::from_local(t, entry->mesh, {*layout});
    }
  }
}

// [Note: tensor parallelism on the module seam] A parallelized module's hooks do what
// PyTorch's style hooks do, at its boundary and above autograd: its first input to the
// style's desired input layout (prepare_module_input), its other inputs per
// more_input_layouts, its outputs to the style's output layout (tp_module_output). Called as
// module->forward(...), the ops do the same conversions below autograd ([Note: tensor
// parallelism without module hooks]).
ModuleHooks tp_hooks() {
  return ModuleHooks()
      .name("tensor parallelism")
      .order(hook_order::kTensorParallel)
      .pre_forward([](torch::nn::Module& m, TensorList& inputs) {
        if (!inputs.empty()) {
          inputs[0] = prepare_module_input(m, inputs[0]);
          tp_more_inputs(m, inputs);
        }
      })
      .post_forward([](torch::nn::Module& m, TensorList& outputs) {
        for (at::Tensor& t : outputs) {
          t = detail::tp_module_output(prepare_module_output(m, t), &m);
        }
      });
}

ModuleRegistry<bool>& tp_hooked_modules() {
  static ModuleRegistry<bool> r;
  return r;
}

void tp_hook_module(torch::nn::Module& module) {
  if (tp_hooked_modules().get(module)) {
    return; // a second style on the same module: one set of hooks reads both
  }
  tp_hooked_modules().set(module, module.weak_from_this(), true);
  register_module_hooks(module, tp_hooks());
}

} // namespace

void PrepareModuleOutput::apply(torch::nn::Module& module, const DeviceMesh& tp_mesh) const {
  check_mesh(tp_mesh, name());
  if (!has_own_tp_parameters(module)) {
    module_outputs().set(module, detail::owned_module(module, "PrepareModuleOutput"),
                         ModuleOutput{tp_mesh, *this});
    tp_hook_module(module);
    return;
  }
  for (const auto& layouts : existing_layouts(module, name())) {
    layouts->output = desired_output_layouts();
    layouts->local_output = use_local_output();
  }
}

void parallelize_module(torch::nn::Module& module, const DeviceMesh& tp_mesh,
                        const ParallelStyle& style) {
  style.apply(module, tp_mesh);
}

void parallelize_module(torch::nn::Module& module, const DeviceMesh& tp_mesh,
                        const std::shared_ptr<const ParallelStyle>& style) {
  DTENSOR_CHECK(style != nullptr, "parallelize_module({}): null style", module.name());
  style->apply(module, tp_mesh);
}

namespace {

// Dotted atoms matched one by one, like PyTorch's fnmatch per atom.
bool path_matches(const std::string& pattern, const std::string& path) {
  auto split = [](const std::string& s) {
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t i = 0; i <= s.size(); ++i) {
      if (i == s.size() || s[i] == '.') {
        out.push_back(s.substr(start, i - start));
        start = i + 1;
      }
    }
    return out;
  };
  auto p = split(pattern);
  auto q = split(path);
  if (p.size() != q.size()) {
    return false;
  }
  for (size_t i = 0; i < p.size(); ++i) {
    if (fnmatch(p[i].c_str(), q[i].c_str(), 0) != 0) {
      return false;
    }
  }
  return true;
}

} // namespace

void parallelize_module(torch::nn::Module& module, const DeviceMesh& tp_mesh,
                        const ParallelizePlan& plan) {
  auto named = detail::owned_module(module, "parallelize_module")->named_modules();
  const std::vector<std::string> bypassed = detail::sequential_children(module);
  for (const auto& [pattern, style] : plan) { // checked before any style applies
    DTENSOR_CHECK(style != nullptr, "parallelize_module({}): null style for '{}'", module.name(),
                  pattern);
    for (const std::string& name : bypassed) {
      // [Note: children of a Sequential] (lib/parallel/module_ptr.h)
      DTENSOR_CHECK(!style->needs_module_calls() || !path_matches(pattern, name),
                    "parallelize_module({}): '{}' ({} for plan entry '{}') is called by a "
                    "torch::nn::Sequential, whose forward calls it directly, bypassing "
                    "dtensor::call, where {} acts: it would do nothing",
                    module.name(), name, style->name(), pattern, style->name());
    }
  }
  for (const auto& [pattern, style] : plan) {
    int matched = 0;
    for (const auto& item : named) {
      if (!item.key().empty() && path_matches(pattern, item.key())) {
        style->apply(*item.value(), tp_mesh);
        ++matched;
      }
    }
    DTENSOR_CHECK(matched > 0, "parallelize_module({}): plan entry '{}' ({}) matches no submodule",
                  module.name(), pattern, style->name());
  }
}

void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh,
                       const PartitionFn& partition_fn) {
  DTENSOR_CHECK(mesh.defined(), "distribute_module({}): the mesh is undefined", module.name());
  auto replicate_rest = [&](torch::nn::Module& m) {
    at::NoGradGuard no_grad;
    const Placements all(static_cast<size_t>(mesh.ndim()), Placement::replicate());
    for (auto& p : m.named_parameters(/*recurse=*/false)) {
      if (!is_dtensor(p.value())) {
        detail::replace_data(p.value(), distribute_tensor(p.value().detach(), mesh, all));
      }
    }
    for (auto& b : m.named_buffers(/*recurse=*/false)) {
      if (b.value().defined() && !is_dtensor(b.value())) {
        detail::replace_data(b.value(), distribute_tensor(b.value().detach(), mesh, all));
      }
    }
  };
  for (const auto& item : detail::owned_module(module, "distribute_module")->named_modules()) {
    if (partition_fn) {
      partition_fn(item.key(), *item.value(), mesh);
    }
    replicate_rest(*item.value());
  }
}

} // namespace dtensor
