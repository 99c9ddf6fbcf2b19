// dtensor::optim::Muon (include/dtensor/muon.h): the optimizer's groups, AdamW's step and Muon's
// local part; the owner exchange is in owners.cpp.
#include <dtensor/muon.h>

#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <dtensor/dtensor.h>

#include "internal/check.h"
#include "tensor/dtensor_impl.h"
#include "train/muon/owners.h"

namespace dtensor::optim {

MuonOptions::MuonOptions(double lr) : lr_(lr) {}

namespace {

using detail::muon::Box;
using detail::muon::Matrix;
using detail::muon::NewtonSchulz;
using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;
using torch::optim::OptimizerParamGroup;

void check_options(const MuonOptions& o) {
  DTENSOR_CHECK(o.lr() >= 0, "Muon: lr must be >= 0 (got {})", o.lr());
  DTENSOR_CHECK(o.momentum() >= 0, "Muon: momentum must be >= 0 (got {})", o.momentum());
  DTENSOR_CHECK(o.weight_decay() >= 0, "Muon: weight_decay must be >= 0 (got {})",
                o.weight_decay());
  DTENSOR_CHECK(o.ns_steps() >= 0 && o.ns_steps() < 100,
                "Muon: ns_steps must be in [0, 100) (got {})", o.ns_steps());
  const std::string& fn = o.adjust_lr_fn();
  DTENSOR_CHECK(fn == "original" || fn == "match_rms_adamw" || fn == "spectral_unclamped",
                "Muon: adjust_lr_fn '{}' is not one of original, match_rms_adamw, "
                "spectral_unclamped",
                fn);
}

const AdamWOptions* adamw_of(const OptimizerParamGroup& g) {
  return dynamic_cast<const AdamWOptions*>(&g.options());
}

at::Tensor local_of(const at::Tensor& t) {
  const detail::DTensorMeta* meta = detail::dtensor_meta(t);
  return meta != nullptr ? meta->local : t;
}

// The parameter's gradient in the parameter's placements, as its local tensor.
at::Tensor local_grad(const at::Tensor& p) {
  const at::Tensor& g = p.grad();
  if (!is_dtensor(p)) {
    DTENSOR_CHECK(!is_dtensor(g), "Muon: a plain parameter has a DTensor gradient");
    return g;
  }
  DTENSOR_CHECK(is_dtensor(g), "Muon: a DTensor parameter {} has a plain gradient",
                DTensor(p).spec().to_string());
  const DTensor pd(p);
  const DTensor gd(g);
  return gd.placements() == pd.placements()
             ? local_of(g)
             : local_of(gd.redistribute(pd.device_mesh(), pd.placements()));
}

// torch.optim.AdamW's single-tensor step, on local tensors (elementwise: any layout).
void adamw_step(const at::Tensor& p, AdamWParamState& s, const AdamWOptions& o) {
  const at::Tensor param = local_of(p);
  const at::Tensor grad = local_grad(p);
  const auto [beta1, beta2] = o.betas();
  s.step(s.step() + 1);
  if (o.weight_decay() != 0) {
    param.mul_(1 - o.lr() * o.weight_decay());
  }
  const at::Tensor exp_avg = local_of(s.exp_avg());
  const at::Tensor exp_avg_sq = local_of(s.exp_avg_sq());
  exp_avg.lerp_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  const auto step = static_cast<double>(s.step());
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2_sqrt = std::pow(1 - std::pow(beta2, step), 0.5);
  at::Tensor denom;
  if (o.amsgrad()) {
    at::Tensor max_sq = local_of(s.max_exp_avg_sq());
    at::maximum_out(max_sq, max_sq, exp_avg_sq);
    denom = (max_sq.sqrt() / bias_correction2_sqrt).add_(o.eps());
  } else {
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(o.eps());
  }
  param.addcdiv_(exp_avg, denom, -o.lr() / bias_correction1);
}

AdamWParamState& adamw_state(torch::optim::Optimizer& opt, const at::Tensor& p,
                             const AdamWOptions& o) {
  auto& slot = opt.state()[p.unsafeGetTensorImpl()];
  if (!slot) {
    auto s = std::make_unique<AdamWParamState>();
    s->step(0);
    s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (o.amsgrad()) {
      s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    }
    slot = std::move(s);
  }
  return static_cast<AdamWParamState&>(*slot);
}

double adjusted_lr(const MuonOptions& o, int64_t rows, int64_t cols) {
  const auto a = static_cast<double>(rows);
  const auto b = static_cast<double>(cols);
  if (o.adjust_lr_fn() == "match_rms_adamw") {
    return o.lr() * 0.2 * std::sqrt(std::max(a, b));
  }
  if (o.adjust_lr_fn() == "spectral_unclamped") {
    return o.lr() * std::sqrt(a / b);
  }
  return o.lr() * std::sqrt(std::max(1.0, a / b));
}

// Where one matrix's result goes: a slice of the parameter's local tensor, scaled.
struct Target {
  at::Tensor param;
  double alpha;
};

// The matrices sharded over one group, with where their results go.
struct GroupWork {
  Group group;
  std::vector<Matrix> matrices;
  std::vector<Target> targets;
};

// The group of ranks among which `spec`'s matrices are cut (the ranks that differ from this
// one only on the mesh dimensions sharding a matrix dimension), with each group rank's mesh
// coordinate; an empty group when no mesh dimension cuts them. A batch of matrices (3-D) sharded
// on its batch dimension (experts over ep) has whole matrices there: that dimension is not in
// the group, and every rank of the group holds the same batch entries.
std::pair<Group, std::vector<std::vector<int64_t>>> shard_group(const DTensorSpec& spec) {
  const DeviceMesh& mesh = spec.mesh;
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    const Placement& p = spec.placements[d];
    DTENSOR_CHECK(!p.is_partial(),
                  "Muon: parameter {} is Partial; parameters are Shard or "
                  "Replicate",
                  spec.to_string());
    if (p.is_shard() && mesh.size(d) > 1 && !(spec.ndim() == 3 && p.dim() == 0)) {
      dims.push_back(d);
    }
  }
  if (dims.empty()) {
    return {};
  }
  const std::vector<int64_t> mine = *mesh.get_coordinate();
  int64_t n = 1;
  for (int64_t d : dims) {
    n *= mesh.size(d);
  }
  std::vector<std::vector<int64_t>> coords;
  std::vector<int> ranks;
  for (int64_t g = 0; g < n; ++g) {
    std::vector<int64_t> c = mine;
    int64_t rest = g;
    for (auto d = dims.rbegin(); d != dims.rend(); ++d) {
      c[*d] = rest % mesh.size(*d);
      rest /= mesh.size(*d);
    }
    int64_t flat = 0;
    for (int64_t d = 0; d < mesh.ndim(); ++d) {
      flat = flat * mesh.size(d) + c[d];
    }
    ranks.push_back(mesh.ranks()[flat]);
    coords.push_back(std::move(c));
  }
  if (dims.size() == 1) {
    return {mesh.get_group(dims[0]), std::move(coords)};
  }
  std::string label = "muon";
  for (int64_t d : dims) {
    label += "_" + (mesh.dim_names().empty() ? fmt::format("dim{}", d) : mesh.dim_names()[d]);
  }
  return {new_group(ranks, label), std::move(coords)};
}

GroupWork& work_for(const Group& group, std::vector<GroupWork>& work) {
  for (auto& w : work) {
    if (w.group == group) {
      return w;
    }
  }
  return work.emplace_back(GroupWork{group, {}, {}});
}

// The matrices of one Muon parameter (2-D, or 3-D as a batch of matrices): this rank's local
// batch entries, each orthogonalised here (`local`) or through its group's owner (`work`).
void add_matrices(const at::Tensor& p, const at::Tensor& update, const MuonOptions& o,
                  std::vector<GroupWork>& work, std::vector<std::pair<Matrix, Target>>& local) {
  const bool batched = p.dim() == 3;
  const int64_t rows = p.size(-2);
  const int64_t cols = p.size(-1);
  const NewtonSchulz ns{o.ns_coefficients(), o.ns_steps(), o.eps()};
  const double alpha = -adjusted_lr(o, rows, cols);
  const at::Tensor param = local_of(p);
  const int64_t entries = batched ? param.size(0) : 1;
  const auto entry = [&](const at::Tensor& t, int64_t i) { return batched ? t[i] : t; };
  auto [group, coords] = is_dtensor(p) ? shard_group(DTensor(p).spec())
                                       : std::pair<Group, std::vector<std::vector<int64_t>>>{};
  if (!group.defined()) {
    for (int64_t i = 0; i < entries; ++i) {
      local.emplace_back(Matrix{rows, cols, ns, {}, entry(update, i), {}},
                         Target{entry(param, i), alpha});
    }
    return;
  }
  GroupWork& w = work_for(group, work);
  const DTensorSpec& spec = DTensor(p).spec();
  const size_t k = batched ? 1 : 0;
  std::vector<Box> boxes;
  for (const auto& c : coords) {
    const auto shape = spec.local_shape(c);
    const auto off = spec.local_offset(c);
    boxes.push_back(Box{off[k], off[k + 1], shape[k], shape[k + 1]});
  }
  const bool holds = boxes[group.rank()].numel() > 0;
  for (int64_t i = 0; i < entries; ++i) {
    w.matrices.push_back(
        Matrix{rows, cols, ns, boxes, holds ? entry(update, i) : at::Tensor(), {}});
    w.targets.push_back({holds ? entry(param, i) : at::Tensor(), alpha});
  }
}

} // namespace

// [Note: Muon's groups keep their options] LibTorch's add_param_group merges a group's options
// into the optimizer's defaults (fields equal to their constructor defaults are taken from
// `defaults`), which would turn an AdamW group into a Muon one. Groups are added without options
// and given their own afterwards: a group's options are exactly what it was given.
Muon::Muon(const std::vector<OptimizerParamGroup>& groups, MuonOptions defaults)
    : Optimizer(std::vector<OptimizerParamGroup>{}, std::make_unique<MuonOptions>(defaults)) {
  for (const auto& g : groups) {
    add_param_group(OptimizerParamGroup(g.params()));
    if (g.has_options()) {
      param_groups().back().set_options(g.options().clone());
    }
  }
  for (const auto& g : param_groups()) {
    if (adamw_of(g) != nullptr) {
      continue;
    }
    const auto* o = dynamic_cast<const MuonOptions*>(&g.options());
    DTENSOR_CHECK(o != nullptr, "Muon: a group's options are neither MuonOptions nor "
                                "AdamWOptions");
    check_options(*o);
    for (const auto& p : g.params()) {
      DTENSOR_CHECK(p.dim() == 2 || p.dim() == 3,
                    "Muon: a Muon group takes matrices (2-D) and batches of matrices (3-D); a "
                    "parameter of shape {} belongs in an AdamW group",
                    p.sizes().vec());
      DTENSOR_CHECK(!p.is_complex(), "Muon: complex parameters are not supported");
    }
  }
}

Muon::Muon(std::vector<at::Tensor> params, MuonOptions defaults)
    : Muon(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))},
           std::move(defaults)) {}

at::Tensor Muon::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  std::vector<GroupWork> work;
  std::vector<std::pair<Matrix, Target>> local;
  for (auto& g : param_groups()) {
    if (const AdamWOptions* o = adamw_of(g)) {
      for (const auto& p : g.params()) {
        if (p.grad().defined()) {
          adamw_step(p, adamw_state(*this, p, *o), *o);
        }
      }
      continue;
    }
    const auto& o = static_cast<const MuonOptions&>(g.options());
    for (const auto& p : g.params()) {
      if (!p.grad().defined()) {
        continue;
      }
      DTENSOR_CHECK(!p.grad().is_sparse(), "Muon: sparse gradients are not supported");
      auto& slot = state()[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto s = std::make_unique<MuonParamState>();
        s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      const at::Tensor grad = local_grad(p);
      const at::Tensor buf = local_of(static_cast<MuonParamState&>(*slot).momentum_buffer());
      buf.lerp_(grad, 1 - o.momentum());
      const at::Tensor update = o.nesterov() ? grad.lerp(buf, o.momentum()) : buf;
      local_of(p).mul_(1 - o.lr() * o.weight_decay());
      add_matrices(p, update.to(at::kBFloat16), o, work, local);
    }
  }
  for (auto& [m, t] : local) {
    t.param.add_(detail::muon::newton_schulz(m.piece, m.ns), t.alpha);
  }
  last_.clear();
  for (GroupWork& w : work) {
    last_.push_back(detail::muon::exchange(w.matrices, w.group));
    for (size_t i = 0; i < w.matrices.size(); ++i) {
      if (w.targets[i].param.defined()) {
        w.targets[i].param.add_(w.matrices[i].result, w.targets[i].alpha);
      }
    }
  }
  return loss;
}

std::vector<OptimizerParamGroup> muon_param_groups(const torch::nn::Module& module,
                                                   const MuonOptions& muon,
                                                   const AdamWOptions& adamw,
                                                   const std::vector<std::string>& adamw_names) {
  std::vector<at::Tensor> matrices;
  std::vector<at::Tensor> others;
  for (const auto& item : module.named_parameters()) {
    bool named = false;
    size_t start = 0;
    const std::string& fqn = item.key();
    while (start <= fqn.size()) {
      const size_t dot = std::min(fqn.find('.', start), fqn.size());
      for (const auto& n : adamw_names) {
        named = named || fqn.compare(start, dot - start, n) == 0;
      }
      start = dot + 1;
    }
    const int64_t d = item.value().dim();
    ((d == 2 || d == 3) && !named ? matrices : others).push_back(item.value());
  }
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(std::move(matrices), std::make_unique<MuonOptions>(muon));
  groups.emplace_back(std::move(others), std::make_unique<AdamWOptions>(adamw));
  return groups;
}

} // namespace dtensor::optim
