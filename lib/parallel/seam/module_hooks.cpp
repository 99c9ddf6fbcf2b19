// The module seam (include/dtensor/module_hooks.h): the hooks registered per module and for
// every module, and the call that runs them as nested scopes ([Note: hook order]).
#include <dtensor/module_hooks.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <torch/nn/modules/container/sequential.h>

#include "internal/check.h"
#include "parallel/module_ptr.h"
#include "parallel/seam/attribution.h"

namespace dtensor {

void HookHandle::remove() {
  if (remove_) {
    auto f = std::move(remove_);
    remove_ = nullptr;
    f();
  }
}

namespace detail {

struct ModuleCall {
  std::vector<std::shared_ptr<const ModuleHooks>> hooks; // outermost first
};

namespace {

struct RegisteredHooks {
  uint64_t id;
  std::shared_ptr<const ModuleHooks> hooks;
};

struct HookedModule {
  std::weak_ptr<const torch::nn::Module> owner;
  std::vector<RegisteredHooks> hooks;
};

// [Note: the hook registry] Hooks live here, not on the module (a torch::nn::Module has no
// room for them), keyed by address; the weak pointer tells a live module from a new one at a
// freed module's address (a stale entry is dropped when met). Built-in global hooks are
// registered when the registry is first used, in one list, not by static initialisers.
class HookRegistry {
 public:
  HookRegistry() { add_global(attribution_hooks()); }

  uint64_t add_global(ModuleHooks hooks) {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t id = next_id_++;
    globals_.push_back({id, std::make_shared<const ModuleHooks>(std::move(hooks))});
    return id;
  }

  uint64_t add(torch::nn::Module& module, ModuleHooks hooks) {
    std::weak_ptr<const torch::nn::Module> owner = owned_module(module, "register_module_hooks");
    std::lock_guard<std::mutex> lock(mutex_);
    sweep();
    const uint64_t id = next_id_++;
    HookedModule& e = live_entry(module);
    e.owner = owner;
    e.hooks.push_back({id, std::make_shared<const ModuleHooks>(std::move(hooks))});
    return id;
  }

  void remove(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto drop = [id](std::vector<RegisteredHooks>& v) {
      v.erase(
          std::remove_if(v.begin(), v.end(), [id](const RegisteredHooks& r) { return r.id == id; }),
          v.end());
    };
    drop(globals_);
    for (auto& [m, e] : modules_) {
      drop(e.hooks);
    }
  }

  // Global hooks before the module's at the same order, registration order otherwise.
  std::vector<std::shared_ptr<const ModuleHooks>> ordered(const torch::nn::Module& module) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::shared_ptr<const ModuleHooks>> out;
    for (const RegisteredHooks& r : globals_) {
      out.push_back(r.hooks);
    }
    auto it = modules_.find(&module);
    if (it != modules_.end()) {
      if (it->second.owner.lock().get() != &module) {
        modules_.erase(it);
      } else {
        for (const RegisteredHooks& r : it->second.hooks) {
          out.push_back(r.hooks);
        }
      }
    }
    std::stable_sort(out.begin(), out.end(),
                     [](const auto& a, const auto& b) { return a->order() < b->order(); });
    return out;
  }

 private:
  // Entries of freed modules go when the table has doubled since the last sweep: a program
  // that builds and drops models keeps a table as large as its live hooked modules.
  void sweep() {
    if (modules_.size() < 2 * swept_size_ + 64) {
      return;
    }
    for (auto it = modules_.begin(); it != modules_.end();) {
      it = it->second.owner.expired() ? modules_.erase(it) : std::next(it);
    }
    swept_size_ = modules_.size();
  }

  HookedModule& live_entry(const torch::nn::Module& module) {
    HookedModule& e = modules_[&module];
    if (e.owner.lock().get() != &module) {
      e.hooks.clear(); // a freed module's entry
    }
    return e;
  }

  std::mutex mutex_;
  uint64_t next_id_ = 1;
  size_t swept_size_ = 0;
  std::vector<RegisteredHooks> globals_;
  std::unordered_map<const torch::nn::Module*, HookedModule> modules_;
};

HookRegistry& hook_registry() {
  static HookRegistry r;
  return r;
}

bool hooks_active(const ModuleHooks& h) {
  return !h.active() || h.active()();
}

// Once per call, at the first gradient of any of `outputs` (FSDP2's multi-grad hook, "any").
void register_pre_backward(const std::shared_ptr<torch::nn::Module>& module,
                           const TensorList& outputs, const PreBackwardHook& hook) {
  auto fired = std::make_shared<std::atomic<bool>>(false);
  std::weak_ptr<torch::nn::Module> weak = module;
  for (const at::Tensor& t : outputs) {
    if (t.defined() && t.requires_grad()) {
      t.register_hook([fired, weak, hook](const at::Tensor&) {
        if (!fired->exchange(true)) {
          if (auto m = weak.lock()) {
            hook(*m);
          }
        }
      });
    }
  }
}

TensorList run_hooks_from(const std::shared_ptr<const ModuleCall>& call, size_t i,
                          const std::shared_ptr<torch::nn::Module>& module, TensorList inputs,
                          const ForwardFn& forward) {
  if (i == call->hooks.size()) {
    return forward(inputs);
  }
  const ModuleHooks& h = *call->hooks[i];
  torch::nn::Module& m = *module;
  if (h.pre_forward()) {
    const size_t n = inputs.size();
    h.pre_forward()(m, inputs);
    DTENSOR_CHECK(inputs.size() == n,
                  "module hooks '{}' on {}: pre_forward left {} inputs, the call has {}", h.name(),
                  m.name(), inputs.size(), n);
  }
  TensorList outputs;
  try {
    if (h.around_forward()) {
      ForwardFn inner = [call, i, module, forward](const TensorList& in) {
        return run_hooks_from(call, i + 1, module, in, forward);
      };
      outputs = h.around_forward()(m, inputs, inner);
    } else {
      outputs = run_hooks_from(call, i + 1, module, std::move(inputs), forward);
    }
    if (h.post_forward()) {
      const size_t n = outputs.size();
      h.post_forward()(m, outputs);
      DTENSOR_CHECK(outputs.size() == n,
                    "module hooks '{}' on {}: post_forward left {} outputs, forward returned {}",
                    h.name(), m.name(), outputs.size(), n);
    }
  } catch (...) {
    if (h.forward_failed()) {
      h.forward_failed()(m);
    }
    throw;
  }
  if (h.pre_backward()) {
    register_pre_backward(module, outputs, h.pre_backward());
  }
  return outputs;
}

} // namespace

std::shared_ptr<const ModuleCall> hooks_for_call(const torch::nn::Module& module) {
  std::vector<std::shared_ptr<const ModuleHooks>> all = hook_registry().ordered(module);
  auto call = std::make_shared<ModuleCall>();
  for (auto& h : all) {
    if (hooks_active(*h)) {
      call->hooks.push_back(std::move(h));
    }
  }
  return call->hooks.empty() ? nullptr : std::shared_ptr<const ModuleCall>(std::move(call));
}

TensorList run_module_call(const std::shared_ptr<const ModuleCall>& call,
                           const std::shared_ptr<torch::nn::Module>& module, TensorList inputs,
                           ForwardFn forward) {
  return run_hooks_from(call, 0, module, std::move(inputs), forward);
}

std::shared_ptr<torch::nn::Module> module_owner(torch::nn::Module& module) {
  return owned_module(module, "dtensor::call");
}

std::vector<std::string> sequential_children(const torch::nn::Module& root) {
  std::unordered_set<const torch::nn::Module*> called_by_sequential;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    if (dynamic_cast<const torch::nn::SequentialImpl*>(m.get()) != nullptr) {
      for (const auto& child : m->children()) {
        called_by_sequential.insert(child.get());
      }
    }
  }
  std::vector<std::string> names;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (called_by_sequential.count(item.value().get()) != 0) {
      names.push_back(item.key());
    }
  }
  return names;
}

void check_hook_outputs(const torch::nn::Module& module, size_t got, int want) {
  DTENSOR_CHECK(want >= 0,
                "dtensor::call: an around-forward hook of {} ({}) returned without running "
                "forward, whose return type only forward's own value can rebuild",
                module.name(), fmt::join(module_hook_names(module), ", "));
  DTENSOR_CHECK(got == static_cast<size_t>(want),
                "dtensor::call: an around-forward hook of {} ({}) returned {} tensors without "
                "running forward, which returns {}",
                module.name(), fmt::join(module_hook_names(module), ", "), got, want);
}

} // namespace detail

HookHandle register_module_hooks(torch::nn::Module& module, ModuleHooks hooks) {
  const uint64_t id = detail::hook_registry().add(module, std::move(hooks));
  return HookHandle([id] { detail::hook_registry().remove(id); });
}

HookHandle register_global_module_hooks(ModuleHooks hooks) {
  const uint64_t id = detail::hook_registry().add_global(std::move(hooks));
  return HookHandle([id] { detail::hook_registry().remove(id); });
}

std::vector<std::string> module_hook_names(const torch::nn::Module& module) {
  std::vector<std::string> out;
  for (const auto& h : detail::hook_registry().ordered(module)) {
    out.push_back(h->name());
  }
  return out;
}

} // namespace dtensor
