// CommDebugMode's module attribution on the module seam ([Note: module attribution]).
#include "parallel/seam/attribution.h"

#include <mutex>
#include <unordered_map>

#include <dtensor/dtensor.h>

#include "internal/check.h"
#include "mesh/comm_debug.h"
#include "parallel/tp/tensor_parallel.h" // plain_gradient
#include "tensor/debug/torch_repr.h"

namespace dtensor::detail {

namespace {

// The modules open on this thread (forward runs on one thread), each with the outputs its
// submodules declared (weakly held: a dead one cannot be confused with a new tensor at its
// address). A tensor returned by a module and by its caller keeps the inner module's
// gradient hook only: PyTorch's backward pre-hooks on it run outer first, so the inner module
// ends up current, while hooks on one tensor run in the order they were added.
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
struct Open {
  const torch::nn::Module* module;
  std::string name;
  std::vector<WeakImpl> inner_outputs;
};
thread_local std::vector<Open> open_modules;

bool declared_inside(const Open& scope, const at::Tensor& t) {
  for (const WeakImpl& w : scope.inner_outputs) {
    if (!w.expired() && w._unsafe_get_target() == t.unsafeGetTensorImpl()) {
      return true;
    }
  }
  return false;
}

// Names of the modules under the last root, as PyTorch's tracker knows them; kept after the
// root's forward for the scopes of activation checkpointing's recompute in backward.
struct Names {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, std::string> of;
};

Names& names() {
  static Names n;
  return n;
}

// "MLPModuleImpl" -> "MLPModule", "torch::nn::LinearImpl" -> "Linear".
std::string class_name(const torch::nn::Module& m) {
  std::string n = m.name();
  if (auto sep = n.rfind("::"); sep != std::string::npos) {
    n = n.substr(sep + 2);
  }
  if (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0) {
    n.resize(n.size() - 4);
  }
  return n;
}

void name_tree(std::unordered_map<const torch::nn::Module*, std::string>& of,
               const torch::nn::Module& m, const std::string& name) {
  of.emplace(&m, name); // a module reached twice keeps its first name
  for (const auto& child : m.named_children()) {
    name_tree(of, *child.value(), name + "." + child.key());
  }
}

std::string name_of(const torch::nn::Module& m) {
  Names& n = names();
  std::lock_guard<std::mutex> lock(n.mutex);
  if (open_modules.empty() && !in_autograd_backward()) {
    n.of.clear(); // a new root
    name_tree(n.of, m, class_name(m));
  }
  auto it = n.of.find(&m);
  if (it != n.of.end()) {
    return it->second;
  }
  // Not under the root: a root of its own.
  name_tree(n.of, m, class_name(m));
  return n.of.at(&m);
}

ModuleForward describe(const torch::nn::Module& m, std::string name) {
  ModuleForward f;
  f.name = std::move(name);
  f.type = fmt::format("class '{}'", m.name());
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    const at::Tensor& t = p.value();
    f.parameters.emplace_back(p.key(), is_dtensor(t) ? torch_repr(DTensor(t).placements()) : "", t);
  }
  return f;
}

void attribution_begin(torch::nn::Module& module, TensorList&) {
  std::string name = name_of(module);
  module_forward_begin(describe(module, name));
  open_modules.push_back({&module, std::move(name), {}});
}

// Declares one output ([Note: module attribution]).
void attribution_declare(at::Tensor& out) {
  if (!out.defined()) {
    return;
  }
  if (out.requires_grad() && !declared_inside(open_modules.back(), out)) {
    // A plain output whose gradient arrives as a DTensor is an input of a parallelized op of
    // the next module ([Note: gradients of plain inputs]): its conversion belongs to that
    // module's backward (PyTorch's input hook), so it happens here, before this module
    // becomes current; the input's own hook then finds a plain gradient.
    out.register_hook([name = open_modules.back().name, plain = !is_dtensor(out)](const at::Tensor& grad) {
      at::Tensor g = plain ? plain_gradient(grad) : grad;
      module_backward_begin(name);
      return g;
    });
  }
  if (open_modules.size() > 1) {
    open_modules[open_modules.size() - 2].inner_outputs.emplace_back(out.getIntrusivePtr());
  }
}

void attribution_end(torch::nn::Module&) {
  open_modules.pop_back();
  module_forward_end();
}

} // namespace

ModuleHooks attribution_hooks() {
  return ModuleHooks()
      .name("CommDebugMode")
      .order(hook_order::kAttribution)
      .active([] { return comm_debug_active(); })
      .pre_forward(attribution_begin)
      .post_forward([](torch::nn::Module& m, TensorList& outputs) {
        for (at::Tensor& t : outputs) {
          attribution_declare(t);
        }
        attribution_end(m);
      })
      .forward_failed(attribution_end);
}

} // namespace dtensor::detail
