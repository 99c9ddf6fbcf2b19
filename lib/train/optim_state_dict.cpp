// Optimizer state dicts keyed by parameter name (include/dtensor/optim_state_dict.h).
#include <dtensor/optim_state_dict.h>

#include <map>
#include <optional>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <dtensor/dtensor.h>
#include <dtensor/muon.h>

#include "internal/check.h"

namespace dtensor {

namespace {

using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamState;
using Fields = std::vector<std::pair<std::string, at::Tensor>>;

// [Note: optimizer tables] One entry per supported optimizer: its per-parameter state
// fields and its hyperparameters, read and written by name. Adam and AdamW share the shape.
template <class State>
Fields adam_fields(const State& s) {
  Fields out{{"step", at::scalar_tensor(static_cast<double>(s.step()), at::kFloat)}};
  for (const auto& [name, t] : Fields{{"exp_avg", s.exp_avg()},
                                      {"exp_avg_sq", s.exp_avg_sq()},
                                      {"max_exp_avg_sq", s.max_exp_avg_sq()}}) {
    if (t.defined()) {
      out.emplace_back(name, t);
    }
  }
  return out;
}

template <class State>
bool set_adam_field(State& s, const std::string& field, const at::Tensor& v) {
  if (field == "step") {
    s.step(static_cast<int64_t>(v.item<double>()));
  } else if (field == "exp_avg") {
    s.exp_avg(v);
  } else if (field == "exp_avg_sq") {
    s.exp_avg_sq(v);
  } else if (field == "max_exp_avg_sq") {
    s.max_exp_avg_sq(v);
  } else {
    return false;
  }
  return true;
}

template <class Options>
Fields adam_options(const Options& o) {
  const auto [b1, b2] = o.betas();
  return {{"lr", at::scalar_tensor(o.lr(), at::kDouble)},
          {"betas", at::tensor({b1, b2}, at::kDouble)},
          {"eps", at::scalar_tensor(o.eps(), at::kDouble)},
          {"weight_decay", at::scalar_tensor(o.weight_decay(), at::kDouble)},
          {"amsgrad", at::scalar_tensor(o.amsgrad() ? 1.0 : 0.0, at::kDouble)}};
}

template <class Options>
bool set_adam_option(Options& o, const std::string& name, const at::Tensor& v) {
  const at::Tensor d = v.to(at::kDouble);
  if (name == "lr") {
    o.lr(d.item<double>());
  } else if (name == "betas") {
    o.betas(std::make_tuple(d[0].item<double>(), d[1].item<double>()));
  } else if (name == "eps") {
    o.eps(d.item<double>());
  } else if (name == "weight_decay") {
    o.weight_decay(d.item<double>());
  } else if (name == "amsgrad") {
    o.amsgrad(d.item<double>() != 0);
  } else {
    return false;
  }
  return true;
}

Fields sgd_options(const torch::optim::SGDOptions& o) {
  return {{"lr", at::scalar_tensor(o.lr(), at::kDouble)},
          {"momentum", at::scalar_tensor(o.momentum(), at::kDouble)},
          {"dampening", at::scalar_tensor(o.dampening(), at::kDouble)},
          {"weight_decay", at::scalar_tensor(o.weight_decay(), at::kDouble)},
          {"nesterov", at::scalar_tensor(o.nesterov() ? 1.0 : 0.0, at::kDouble)}};
}

bool set_sgd_option(torch::optim::SGDOptions& o, const std::string& name, const at::Tensor& v) {
  const double d = v.to(at::kDouble).item<double>();
  if (name == "lr") {
    o.lr(d);
  } else if (name == "momentum") {
    o.momentum(d);
  } else if (name == "dampening") {
    o.dampening(d);
  } else if (name == "weight_decay") {
    o.weight_decay(d);
  } else if (name == "nesterov") {
    o.nesterov(d != 0);
  } else {
    return false;
  }
  return true;
}

struct OptimizerKind {
  const char* name;
  bool (*is)(const torch::optim::Optimizer&);
  std::unique_ptr<OptimizerParamState> (*new_state)(const OptimizerOptions&);
  Fields (*fields)(const OptimizerParamState&);
  bool (*set_field)(OptimizerParamState&, const std::string&, const at::Tensor&);
  Fields (*options)(const OptimizerOptions&);
  bool (*set_option)(OptimizerOptions&, const std::string&, const at::Tensor&);
  // The state the optimizer's first step would create (nullptr: none), see [Note: initial states].
  std::unique_ptr<OptimizerParamState> (*initial_state)(const at::Tensor& param, const OptimizerOptions&);
};

// [Note: initial states] As PyTorch's get_optimizer_state_dict (which steps once with zero
// gradients), a parameter that has no state yet gets the state its first step would create,
// so that a fresh optimizer's state dict has every key a checkpoint can fill. Adam and AdamW
// then step exactly as if nothing had happened (step 0, zero moments). SGD with momentum
// gets a zero buffer, which its first step turns into (1 - dampening) * grad rather than
// grad: the same as PyTorch, and identical without dampening.
template <class State, class Options>
std::unique_ptr<OptimizerParamState> adam_initial_state(const at::Tensor& p, const OptimizerOptions& o) {
  auto s = std::make_unique<State>();
  s->step(0);
  s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
  s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  if (static_cast<const Options&>(o).amsgrad()) {
    s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  }
  return s;
}

std::unique_ptr<OptimizerParamState> sgd_initial_state(const at::Tensor& p, const OptimizerOptions& o) {
  if (static_cast<const torch::optim::SGDOptions&>(o).momentum() == 0) {
    return nullptr;
  }
  auto s = std::make_unique<torch::optim::SGDParamState>();
  s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
  return s;
}

template <class Opt, class State, class Options>
OptimizerKind adam_like(const char* name) {
  return {name,
          [](const torch::optim::Optimizer& o) { return dynamic_cast<const Opt*>(&o) != nullptr; },
          [](const OptimizerOptions&) -> std::unique_ptr<OptimizerParamState> {
            return std::make_unique<State>();
          },
          [](const OptimizerParamState& s) { return adam_fields(static_cast<const State&>(s)); },
          [](OptimizerParamState& s, const std::string& f, const at::Tensor& v) {
            return set_adam_field(static_cast<State&>(s), f, v);
          },
          [](const OptimizerOptions& o) { return adam_options(static_cast<const Options&>(o)); },
          [](OptimizerOptions& o, const std::string& n, const at::Tensor& v) {
            return set_adam_option(static_cast<Options&>(o), n, v);
          },
          adam_initial_state<State, Options>};
}

// [Note: Muon's state dict] One optimizer, two kinds of groups (include/dtensor/muon.h): an
// AdamW group's parameters have AdamW's fields and options; a Muon group's have PyTorch's
// Muon names: the state "momentum_buffer", the options lr, weight_decay, momentum, nesterov,
// ns_coefficients, eps and ns_steps (adjust_lr_fn is a string, which a state dict of tensors
// does not hold: it stays what the optimizer was built with).
bool adamw_group(const OptimizerOptions& o) {
  return dynamic_cast<const torch::optim::AdamWOptions*>(&o) != nullptr;
}

Fields muon_options(const optim::MuonOptions& o) {
  const auto [a, b, c] = o.ns_coefficients();
  return {{"lr", at::scalar_tensor(o.lr(), at::kDouble)},
          {"weight_decay", at::scalar_tensor(o.weight_decay(), at::kDouble)},
          {"momentum", at::scalar_tensor(o.momentum(), at::kDouble)},
          {"nesterov", at::scalar_tensor(o.nesterov() ? 1.0 : 0.0, at::kDouble)},
          {"ns_coefficients", at::tensor({a, b, c}, at::kDouble)},
          {"eps", at::scalar_tensor(o.eps(), at::kDouble)},
          {"ns_steps", at::scalar_tensor(static_cast<double>(o.ns_steps()), at::kDouble)}};
}

bool set_muon_option(optim::MuonOptions& o, const std::string& name, const at::Tensor& v) {
  const at::Tensor d = v.to(at::kDouble);
  if (name == "ns_coefficients") {
    if (d.numel() == 3) {
      o.ns_coefficients({d[0].item<double>(), d[1].item<double>(), d[2].item<double>()});
    }
    return true;
  }
  const double x = d.numel() == 1 ? d.item<double>() : 0.0;
  if (name == "lr") {
    o.lr(x);
  } else if (name == "weight_decay") {
    o.weight_decay(x);
  } else if (name == "momentum") {
    o.momentum(x);
  } else if (name == "nesterov") {
    o.nesterov(x != 0);
  } else if (name == "eps") {
    o.eps(x);
  } else if (name == "ns_steps") {
    o.ns_steps(static_cast<int64_t>(x));
  } else {
    return false;
  }
  return true;
}

OptimizerKind muon_kind() {
  using torch::optim::AdamWOptions;
  using torch::optim::AdamWParamState;
  using optim::MuonOptions;
  using optim::MuonParamState;
  return {
      "Muon",
      [](const torch::optim::Optimizer& o) {
        return dynamic_cast<const optim::Muon*>(&o) != nullptr;
      },
      [](const OptimizerOptions& o) -> std::unique_ptr<OptimizerParamState> {
        if (adamw_group(o)) {
          return std::make_unique<AdamWParamState>();
        }
        return std::make_unique<MuonParamState>();
      },
      [](const OptimizerParamState& s) {
        if (const auto* m = dynamic_cast<const MuonParamState*>(&s)) {
          return m->momentum_buffer().defined()
                     ? Fields{{"momentum_buffer", m->momentum_buffer()}}
                     : Fields{};
        }
        return adam_fields(static_cast<const AdamWParamState&>(s));
      },
      [](OptimizerParamState& s, const std::string& f, const at::Tensor& v) {
        if (auto* m = dynamic_cast<MuonParamState*>(&s)) {
          if (f == "momentum_buffer") {
            m->momentum_buffer(v);
          }
          return f == "momentum_buffer";
        }
        return set_adam_field(static_cast<AdamWParamState&>(s), f, v);
      },
      [](const OptimizerOptions& o) {
        return adamw_group(o) ? adam_options(static_cast<const AdamWOptions&>(o))
                              : muon_options(static_cast<const MuonOptions&>(o));
      },
      [](OptimizerOptions& o, const std::string& n, const at::Tensor& v) {
        return adamw_group(o) ? set_adam_option(static_cast<AdamWOptions&>(o), n, v)
                              : set_muon_option(static_cast<MuonOptions&>(o), n, v);
      },
      [](const at::Tensor& p, const OptimizerOptions& o) -> std::unique_ptr<OptimizerParamState> {
        if (adamw_group(o)) {
          return adam_initial_state<AdamWParamState, AdamWOptions>(p, o);
        }
        auto s = std::make_unique<MuonParamState>();
        s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
        return s;
      }};
}

const std::vector<OptimizerKind>& kinds() {
  using namespace torch::optim;
  static const std::vector<OptimizerKind> table = {
      adam_like<AdamW, AdamWParamState, AdamWOptions>("AdamW"),
      adam_like<Adam, AdamParamState, AdamOptions>("Adam"),
      {"SGD", [](const Optimizer& o) { return dynamic_cast<const SGD*>(&o) != nullptr; },
       [](const OptimizerOptions&) -> std::unique_ptr<OptimizerParamState> {
         return std::make_unique<SGDParamState>();
       },
       [](const OptimizerParamState& s) {
         const auto& m = static_cast<const SGDParamState&>(s).momentum_buffer();
         return m.defined() ? Fields{{"momentum_buffer", m}} : Fields{};
       },
       [](OptimizerParamState& s, const std::string& f, const at::Tensor& v) {
         if (f != "momentum_buffer") {
           return false;
         }
         static_cast<SGDParamState&>(s).momentum_buffer(v);
         return true;
       },
       [](const OptimizerOptions& o) { return sgd_options(static_cast<const SGDOptions&>(o)); },
       [](OptimizerOptions& o, const std::string& n, const at::Tensor& v) {
         return set_sgd_option(static_cast<SGDOptions&>(o), n, v);
       },
       sgd_initial_state},
      muon_kind(),
  };
  return table;
}

const OptimizerKind& kind_of(const torch::optim::Optimizer& opt) {
  for (const auto& k : kinds()) {
    if (k.is(opt)) {
      return k;
    }
  }
  DTENSOR_FAIL("optimizer state dict: supported optimizers are SGD, Adam, AdamW and Muon");
}

// The module's parameters that the optimizer holds, by name, with their group.
struct NamedParam {
  std::string fqn;
  at::Tensor param;
  torch::optim::OptimizerParamGroup* group;
};

std::vector<NamedParam> named_params(torch::nn::Module& module, torch::optim::Optimizer& opt) {
  std::map<const void*, torch::optim::OptimizerParamGroup*> group_of;
  for (auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) {
      group_of[p.unsafeGetTensorImpl()] = &g;
    }
  }
  std::vector<NamedParam> out;
  for (const auto& item : module.named_parameters()) {
    auto it = group_of.find(item.value().unsafeGetTensorImpl());
    if (it != group_of.end()) {
      out.push_back({item.key(), item.value(), it->second});
    }
  }
  return out;
}

at::Tensor exported(const at::Tensor& t, const StateDictOptions& options) {
  at::NoGradGuard no_grad;
  at::Tensor v = options.full_state_dict() && is_dtensor(t) ? DTensor(t).full_tensor() : t;
  return options.cpu_offload() ? v.cpu() : v;
}

// A value in the parameter's layout: redistributed (DTensor) or cut locally (full value).
at::Tensor in_param_layout(const at::Tensor& v, const at::Tensor& param) {
  at::NoGradGuard no_grad;
  if (!is_dtensor(param)) {
    return (is_dtensor(v) ? DTensor(v).full_tensor() : v).to(param.device()).clone();
  }
  const DTensor p(param);
  at::Tensor whole = v;
  if (is_dtensor(v)) {
    const DTensor d(v);
    if (d.device_mesh() == p.device_mesh()) {
      return d.placements() == p.placements()
                 ? at::Tensor(d).clone()
                 : at::Tensor(d.redistribute(p.device_mesh(), p.placements()));
    }
    whole = d.full_tensor(); // another mesh (another layout): through the full value
  }
  return distribute_tensor(whole.to(param.device()), p.device_mesh(), p.placements(),
                           /*src_data_rank=*/std::nullopt);
}

struct Entry {
  const NamedParam* param;
  bool is_state;
  std::string field;
  at::Tensor value;
};

// Every key parsed and checked before anything is written.
std::vector<Entry> parse(const StateDict& state, const std::vector<NamedParam>& params,
                         const OptimizerKind& kind) {
  std::map<std::string, const NamedParam*> by_name;
  for (const auto& p : params) {
    by_name[p.fqn] = &p;
  }
  std::vector<Entry> out;
  for (const auto& item : state) {
    const std::string& key = item.key();
    const bool is_state = key.rfind("state.", 0) == 0;
    const bool is_group = key.rfind("param_groups.", 0) == 0;
    const auto dot = key.rfind('.');
    DTENSOR_CHECK((is_state || is_group) && dot != std::string::npos &&
                      dot > (is_state ? 6u : 13u),
                  "set_optimizer_state_dict: key '{}' is neither 'state.<param>.<field>' nor "
                  "'param_groups.<param>.<option>'",
                  key);
    const std::string fqn = key.substr(is_state ? 6 : 13, dot - (is_state ? 6 : 13));
    auto it = by_name.find(fqn);
    DTENSOR_CHECK(it != by_name.end(),
                  "set_optimizer_state_dict: key '{}' names '{}', which is not a parameter of "
                  "the module held by the optimizer",
                  key, fqn);
    Entry e{it->second, is_state, key.substr(dot + 1), item.value()};
    if (is_state && e.field != "step") {
      const auto want = is_dtensor(e.param->param) ? DTensor(e.param->param).spec().shape
                                                   : e.param->param.sizes().vec();
      const auto got = is_dtensor(e.value) ? DTensor(e.value).spec().shape : e.value.sizes().vec();
      DTENSOR_CHECK(got == want, "set_optimizer_state_dict: '{}' has shape {} but parameter '{}' is {}",
                    key, got, fqn, want);
    }
    out.push_back(std::move(e));
  }
  // Field and option names are checked on scratch objects of the optimizer's kind.
  for (const Entry& e : out) {
    auto scratch_state = kind.new_state(e.param->group->options());
    std::unique_ptr<OptimizerOptions> scratch_options = e.param->group->options().clone();
    const at::Tensor probe = e.field == "betas" ? at::zeros({2}, at::kDouble) : at::zeros({}, at::kDouble);
    const bool known = e.is_state ? kind.set_field(*scratch_state, e.field, probe)
                                  : kind.set_option(*scratch_options, e.field, probe);
    DTENSOR_CHECK(known, "set_optimizer_state_dict: {} has no {} '{}' (key '{}')", kind.name,
                  e.is_state ? "state field" : "option", e.field,
                  (e.is_state ? "state." : "param_groups.") + e.param->fqn + "." + e.field);
  }
  return out;
}

} // namespace

StateDict get_optimizer_state_dict(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& options) {
  const OptimizerKind& kind = kind_of(optimizer);
  StateDict out;
  at::NoGradGuard no_grad;
  for (const NamedParam& p : named_params(module, optimizer)) {
    auto it = optimizer.state().find(p.param.unsafeGetTensorImpl());
    if (it == optimizer.state().end()) {
      if (auto initial = kind.initial_state(p.param, p.group->options())) {
        it = optimizer.state().emplace(p.param.unsafeGetTensorImpl(), std::move(initial)).first;
      }
    }
    if (it != optimizer.state().end()) {
      for (const auto& [field, t] : kind.fields(*it->second)) {
        out.insert("state." + p.fqn + "." + field, exported(t, options));
      }
    }
    for (const auto& [name, v] : kind.options(p.group->options())) {
      out.insert("param_groups." + p.fqn + "." + name, v);
    }
  }
  if (options.full_state_dict() && options.cpu_offload() && get_rank() != 0) {
    return StateDict();
  }
  return out;
}

void set_optimizer_state_dict(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                              const StateDict& state, const StateDictOptions& options) {
  DTENSOR_CHECK(!options.broadcast_from_rank0(),
                "set_optimizer_state_dict: broadcast_from_rank0 is not supported; pass the full "
                "state dict on every rank");
  const OptimizerKind& kind = kind_of(optimizer);
  const std::vector<NamedParam> params = named_params(module, optimizer);
  const std::vector<Entry> entries = parse(state, params, kind);
  for (const Entry& e : entries) {
    if (!e.is_state) {
      kind.set_option(e.param->group->options(), e.field, e.value);
      continue;
    }
    auto& slot = optimizer.state()[e.param->param.unsafeGetTensorImpl()];
    if (!slot) {
      slot = kind.new_state(e.param->group->options());
    }
    kind.set_field(*slot, e.field,
                   e.field == "step" ? (is_dtensor(e.value) ? DTensor(e.value).full_tensor() : e.value)
                                     : in_param_layout(e.value, e.param->param));
  }
}

} // namespace dtensor
