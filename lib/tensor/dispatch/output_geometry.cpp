// Output geometry: the global shapes and strides of an op's outputs (tensor/dispatch/decision.h).
#include "tensor/dispatch/decision.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/ScopeExit.h>

#include "internal/check.h"
#include "tensor/dispatch/handler.h"

namespace dtensor::detail {

namespace {

at::Tensor meta_of(const DTensorSpec& s) {
  return at::empty_strided(s.shape, s.stride, at::TensorOptions().dtype(s.dtype).device(at::kMeta));
}

thread_local bool inferring_shapes = false;

} // namespace

// Runs the op on meta tensors with global shapes to learn the outputs' global shapes.
void infer_output_shapes(const c10::OperatorHandle& op, const OpInfo& info, Cached& out) {
  const bool outer = inferring_shapes;
  inferring_shapes = true;
  const auto restore = c10::make_scope_exit([outer] { inferring_shapes = outer; });
  torch::jit::Stack meta;
  for (size_t i = 0; i < info.num_args(); ++i) {
    const c10::IValue& v = info.arg(i);
    if (info.specs[i]) {
      meta.emplace_back(meta_of(*info.specs[i]));
    } else if (!info.list_specs[i].empty() && v.isTensorList()) {
      c10::List<at::Tensor> l;
      for (const auto& s : info.list_specs[i]) {
        l.push_back(meta_of(s));
      }
      meta.emplace_back(l);
    } else if (!info.list_specs[i].empty()) { // Tensor?[], DTensors in order
      c10::List<std::optional<at::Tensor>> l;
      size_t k = 0;
      for (const c10::IValue& x : v.toListRef()) {
        l.push_back(x.isTensor() ? std::optional<at::Tensor>(meta_of(info.list_specs[i][k++]))
                                 : std::nullopt);
      }
      meta.emplace_back(l);
    } else if (v.isTensor() && v.toTensor().defined()) {
      meta.emplace_back(v.toTensor().to(at::kMeta));
    } else if (v.isDevice()) {
      meta.emplace_back(c10::Device(at::kMeta)); // _to_copy(..., device=cpu) and factories
    } else {
      meta.push_back(v);
    }
  }
  try {
    op.callBoxed(meta);
  } catch (const c10::Error& e) {
    for (const auto& placements : out.sharding.outputs) {
      for (const auto& p : placements) {
        if (p.is_shard() && p.dim() >= out.sharding.leading_dims_from_input) {
          fail_unsupported(info,
                           fmt::format("its output shape could not be inferred on meta tensors "
                                       "and its rule gives none ({})",
                                       e.what_without_backtrace()));
        }
      }
    }
    out.shapes_from_local = true;
    return;
  }
  for (const auto& r : meta) {
    std::vector<std::vector<int64_t>> shapes;
    std::vector<std::vector<int64_t>> strides;
    if (r.isTensor()) {
      const at::Tensor& t = r.toTensor();
      shapes.push_back(t.defined() ? t.sizes().vec() : std::vector<int64_t>{});
      strides.push_back(t.defined() ? t.strides().vec() : std::vector<int64_t>{});
    } else if (r.isTensorList()) {
      for (const at::Tensor& t : r.toTensorVector()) {
        shapes.push_back(t.sizes().vec());
        strides.push_back(t.strides().vec());
      }
    }
    out.out_shapes.push_back(std::move(shapes));
    out.out_strides.push_back(std::move(strides));
  }
}

namespace {

// [Note: global strides]
// A DTensor's sizes and strides are the global tensor's, as the plain op would give them:
// `d.transpose(1, 2).is_contiguous()` must be false so that `contiguous()` copies and the
// attention reshape `.contiguous().view(...)` works. The meta run gives the exact strides
// (views included). Rules that give output shapes skip the meta run (some kernels have no
// Meta kernel in C++); their outputs are new tensors, dense in the order of the local
// result's strides, which is what the plain op gives (TensorIterator keeps the inputs'
// dimension order).
std::vector<int64_t> dense_strides_like(const at::Tensor& local,
                                        const std::vector<int64_t>& shape) {
  const auto ndim = static_cast<int64_t>(shape.size());
  if (local.dim() != ndim || local.is_contiguous()) {
    return contiguous_strides(shape);
  }
  std::vector<int64_t> order(static_cast<size_t>(ndim));
  for (int64_t d = 0; d < ndim; ++d) {
    order[static_cast<size_t>(d)] = d;
  }
  // Outermost first: larger local stride first; ties keep the logical order.
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return local.stride(a) > local.stride(b); });
  std::vector<int64_t> stride(static_cast<size_t>(ndim), 1);
  int64_t running = 1;
  for (size_t k = order.size(); k-- > 0;) {
    auto d = static_cast<size_t>(order[k]);
    stride[d] = running;
    running *= std::max<int64_t>(shape[d], 1);
  }
  return stride;
}

} // namespace

// The spec of output `r` (element `element` of a list output) over local result `local`.
DTensorSpec output_spec(const OpInfo& info, const Cached& decision, size_t r, size_t element,
                        const at::Tensor& local) {
  DTENSOR_CHECK(r < decision.sharding.outputs.size(),
                "{}: its sharding rule gave no placements for output {}", info.name, r);
  DTensorSpec s;
  s.mesh = *info.mesh;
  s.placements = decision.sharding.outputs[r];
  if (decision.shapes_from_local) {
    s.shape = local.sizes().vec();
    s.stride = local.strides().vec();
    const auto lead = std::min<int64_t>(decision.sharding.leading_dims_from_input,
                                        static_cast<int64_t>(s.shape.size()));
    bool resized = false;
    for (const auto& p : s.placements) {
      if (p.is_shard() && p.dim() < lead) {
        s.shape[p.dim()] = info.specs[0]->shape[p.dim()];
        resized = true;
      }
    }
    if (resized) {
      s.stride = dense_strides_like(local, s.shape);
    }
  } else {
    s.shape = decision.out_shapes[r][element];
    s.stride = r < decision.out_strides.size() && element < decision.out_strides[r].size()
                   ? decision.out_strides[r][element]
                   : dense_strides_like(local, s.shape);
  }
  s.dtype = local.scalar_type();
  return s;
}

bool in_shape_inference() {
  return inferring_shapes;
}

} // namespace dtensor::detail
