// GradScaler: torch.amp.GradScaler's semantics on plain, sparse and DTensor gradients.
#include <dtensor/grad_scaler.h>

#include <map>
#include <string>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/optim/optimizer.h>

#include <dtensor/collectives.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "mesh/rank_device.h"
#include "tensor/dtensor_impl.h"
#include "train/mesh_union.h"

namespace dtensor {

namespace {

// [Note: agreeing on found-inf]
// A non-finite value in one rank's shard of one gradient must make every rank skip the
// step, or the replicas diverge silently. Each rank checks its local pieces (one
// _amp_foreach_non_finite_check_and_unscale_ per (device, dtype) group) into one flag,
// which is then all-reduced with MAX once per mesh dimension over which some parameter or
// gradient is sharded or partial: on the other dimensions every rank already holds the same
// values, hence the same flag. The dimensions are those of the union of all parameters'
// meshes (slices of one root mesh placed on the root's named dims, as clip_grad_norm_
// does), not the first gradient's mesh only: PyTorch 2.9 reduces over grads[0]'s mesh, so a
// model with FSDP-only and FSDP x TP blocks disagrees across ranks. The parameters decide
// the meshes, so a rank without gradients still takes part in the same all-reduces.
struct Agreement {
  std::vector<DeviceMesh> meshes;
  std::vector<std::pair<DeviceMesh, Placements>> layouts; // non-Replicate somewhere
};

void note_layout(Agreement& a, const detail::DTensorMeta& m) {
  a.meshes.push_back(m.spec.mesh);
  for (const auto& p : m.spec.placements) {
    if (!p.is_replicate()) {
      a.layouts.emplace_back(m.spec.mesh, m.spec.placements);
      return;
    }
  }
}

void agree_found_inf(at::Tensor& found, const Agreement& a) {
  if (a.meshes.empty()) {
    return;
  }
  const detail::MeshUnion u = detail::mesh_union(a.meshes, "GradScaler::unscale_");
  std::vector<bool> reduce(static_cast<size_t>(u.mesh.ndim()), false);
  for (const auto& [mesh, placements] : a.layouts) {
    const auto& map = u.map_of(mesh);
    for (size_t d = 0; d < placements.size(); ++d) {
      if (!placements[d].is_replicate()) {
        reduce[static_cast<size_t>(map[d])] = true;
      }
    }
  }
  const at::Device home = found.device();
  at::Tensor wire = found.to(u.mesh.device_type() == c10::DeviceType::CUDA
                                 ? detail::rank_device(c10::kCUDA)
                                 : at::Device(at::kCPU))
                        .contiguous();
  for (int64_t d = 0; d < u.mesh.ndim(); ++d) {
    if (reduce[static_cast<size_t>(d)]) {
      dtensor::all_reduce_(wire, ReduceOp::Max, u.mesh.get_group(d), detail::known_sizes());
    }
  }
  found = wire.to(home);
}

c10::IValue scale_nested(GradScaler& scaler, const c10::IValue& v) {
  if (v.isTensor()) {
    return scaler.scale(v.toTensor());
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorVector()) {
      out.push_back(scaler.scale(t));
    }
    return out;
  }
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const c10::IValue& e : v.toListRef()) {
      out.push_back(scale_nested(scaler, e));
    }
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> out;
    for (const c10::IValue& e : v.toTupleRef().elements()) {
      out.push_back(scale_nested(scaler, e));
    }
    return c10::ivalue::Tuple::create(std::move(out));
  }
  DTENSOR_FAIL("GradScaler::scale: outputs must be tensors or (nested) lists / tuples of tensors, "
               "got {}",
               v.tagKind());
}

} // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  DTENSOR_CHECK(options_.growth_factor() > 1.0, "GradScaler: growth_factor {} must be > 1",
                options_.growth_factor());
  DTENSOR_CHECK(options_.backoff_factor() < 1.0 && options_.backoff_factor() > 0.0,
                "GradScaler: backoff_factor {} must be in (0, 1)", options_.backoff_factor());
  DTENSOR_CHECK(options_.growth_interval() > 0, "GradScaler: growth_interval {} must be > 0",
                options_.growth_interval());
}

void GradScaler::lazy_init(const at::Device& device) {
  if (!scale_.defined()) {
    scale_ = at::full({}, options_.init_scale(), at::TensorOptions().dtype(at::kFloat).device(device));
    growth_tracker_ = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device));
  }
}

GradScaler::PerOptimizer& GradScaler::state_of(const torch::optim::Optimizer& optimizer) {
  return per_optimizer_[&optimizer];
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!options_.enabled()) {
    return outputs;
  }
  DTENSOR_CHECK(outputs.defined(), "GradScaler::scale: undefined tensor");
  lazy_init(outputs.device());
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> out;
  out.reserve(outputs.size());
  for (const auto& t : outputs) {
    out.push_back(scale(t));
  }
  return out;
}

c10::IValue GradScaler::scale(const c10::IValue& outputs) {
  if (!options_.enabled()) {
    return outputs;
  }
  return scale_nested(*this, outputs);
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    return;
  }
  PerOptimizer& st = state_of(optimizer);
  DTENSOR_CHECK(st.stage != Stage::Unscaled,
                "GradScaler::unscale_: already called on this optimizer since the last update()");
  DTENSOR_CHECK(st.stage != Stage::Stepped, "GradScaler::unscale_: called after step()");
  DTENSOR_CHECK(scale_.defined(),
                "GradScaler::unscale_: no scale yet; call scale(loss) earlier in the iteration");
  c10::NoGradGuard no_grad;
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);

  // Local pieces grouped by (device, dtype); the layouts that decide the agreement.
  std::map<std::string, std::vector<at::Tensor>> groups;
  std::map<std::string, at::Device> group_device;
  Agreement agreement;
  std::optional<at::Device> first_device;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (const detail::DTensorMeta* pm = detail::dtensor_meta(p)) {
        note_layout(agreement, *pm);
      }
      at::Tensor g = p.grad();
      if (!g.defined()) {
        continue;
      }
      at::Tensor local;
      if (const detail::DTensorMeta* gm = detail::dtensor_meta(g)) {
        note_layout(agreement, *gm);
        local = gm->local;
      } else if (g.is_sparse()) {
        if (g.scalar_type() == at::kHalf && !g.is_coalesced()) {
          g = g.coalesce(); // duplicate indices may overflow only when summed
          p.mutable_grad() = g;
        }
        local = g._values();
      } else {
        local = g;
      }
      first_device = first_device.value_or(local.device());
      std::string key = fmt::format("{}/{}", local.device().str(), c10::toString(local.scalar_type()));
      groups[key].push_back(local);
      group_device.emplace(key, local.device());
    }
  }
  const at::Device home = first_device.value_or(scale_.device());
  std::map<std::string, at::Tensor> per_device;
  for (auto& [key, tensors] : groups) {
    const at::Device device = group_device.at(key);
    at::Tensor& found = per_device[device.str()];
    if (!found.defined()) {
      found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
    }
    at::_amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale.to(device));
  }
  at::Tensor found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(home));
  for (const auto& [device, f] : per_device) {
    found.add_(f.to(home));
  }
  agree_found_inf(found, agreement);
  st.found_inf = (found > 0).to(at::kFloat);
  st.stage = Stage::Unscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  PerOptimizer& st = state_of(optimizer);
  DTENSOR_CHECK(st.stage != Stage::Stepped,
                "GradScaler::step: already called on this optimizer since the last update()");
  if (st.stage == Stage::Ready) {
    unscale_(optimizer);
  }
  const bool skip = st.found_inf.item<float>() != 0.0F;
  if (!skip) {
    optimizer.step();
  }
  st.stage = Stage::Stepped;
  return !skip;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled()) {
    return;
  }
  DTENSOR_CHECK(scale_.defined(), "GradScaler::update: no scale yet; call scale(loss) first");
  c10::NoGradGuard no_grad;
  if (new_scale) {
    scale_.fill_(*new_scale);
  } else {
    at::Tensor found = at::zeros({1}, scale_.options());
    bool any = false;
    for (const auto& [opt, st] : per_optimizer_) {
      if (st.found_inf.defined()) {
        found.add_(st.found_inf.to(scale_.device()));
        any = true;
      }
    }
    DTENSOR_CHECK(any, "GradScaler::update: no inf checks were recorded (call step() or "
                       "unscale_() before update())");
    at::_amp_update_scale_(scale_, growth_tracker_, found, options_.growth_factor(),
                           options_.backoff_factor(), options_.growth_interval());
  }
  per_optimizer_.clear();
}

at::Tensor GradScaler::found_inf(const torch::optim::Optimizer& optimizer) const {
  auto it = per_optimizer_.find(&optimizer);
  return it == per_optimizer_.end() ? at::Tensor() : it->second.found_inf;
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) {
    return 1.0;
  }
  return scale_.defined() ? scale_.item<double>() : options_.init_scale();
}

int64_t GradScaler::get_growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : 0;
}

GradScalerState GradScaler::state_dict() const {
  GradScalerState s;
  s.scale = get_scale();
  s.growth_factor = options_.growth_factor();
  s.backoff_factor = options_.backoff_factor();
  s.growth_interval = options_.growth_interval();
  s.growth_tracker = get_growth_tracker();
  return s;
}

void GradScaler::load_state_dict(const GradScalerState& state) {
  options_.init_scale(state.scale)
      .growth_factor(state.growth_factor)
      .backoff_factor(state.backoff_factor)
      .growth_interval(state.growth_interval);
  if (scale_.defined()) {
    scale_.fill_(state.scale);
    growth_tracker_.fill_(state.growth_tracker);
  } else {
    lazy_init(at::kCPU);
    growth_tracker_.fill_(state.growth_tracker);
  }
}

} // namespace dtensor
