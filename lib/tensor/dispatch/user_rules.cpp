// local_map and ImplicitReplication (include/dtensor/user_rules.h): user code next to
// DTensors. ImplicitReplication is an interceptor of the dispatch handler ([Note: op
// interceptors]) that turns plain tensor arguments into Replicate DTensors.
#include <atomic>

#include <dtensor/dtensor.h>
#include <dtensor/user_rules.h>

#include "internal/check.h"
#include "tensor/dispatch/interceptors.h"
#include "tensor/dispatch/op_args.h"
#include "tensor/dtensor_impl.h"

namespace dtensor {

namespace {

std::atomic<int> implicit_replication_scopes{0};

const DeviceMesh* mesh_of_inputs(const std::vector<at::Tensor>& inputs) {
  const DeviceMesh* mesh = nullptr;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !is_dtensor(inputs[i])) {
      continue;
    }
    const DeviceMesh& m = DTensor(inputs[i]).device_mesh();
    DTENSOR_CHECK(mesh == nullptr || *mesh == m,
                  "local_map: DTensor inputs live on different meshes: {} and {} (input {})",
                  mesh == nullptr ? "" : mesh->to_string(), m.to_string(), i);
    mesh = &m;
  }
  return mesh;
}

at::Tensor local_input(const at::Tensor& t, size_t i, const LocalMapOptions& o) {
  DTensor d(t);
  if (i < o.in_placements().size() && o.in_placements()[i] &&
      *o.in_placements()[i] != d.placements()) {
    DTENSOR_CHECK(o.redistribute_inputs(),
                  "local_map: input {} is a DTensor with placements {}, but in_placements[{}] "
                  "is {}; redistribute it first or set redistribute_inputs",
                  i, to_string(d.placements()), i, to_string(*o.in_placements()[i]));
    d = d.redistribute(d.device_mesh(), *o.in_placements()[i]);
  }
  return d.to_local();
}

} // namespace

LocalFn local_map(LocalFn fn, LocalMapOptions options) {
  DTENSOR_CHECK(static_cast<bool>(fn), "local_map: no function given");
  return [fn = std::move(fn), o = std::move(options)](const std::vector<at::Tensor>& inputs) {
    DTENSOR_CHECK(o.in_placements().empty() || o.in_placements().size() == inputs.size(),
                  "local_map: {} in_placements for {} inputs", o.in_placements().size(),
                  inputs.size());
    const DeviceMesh* mesh = mesh_of_inputs(inputs);
    if (mesh == nullptr) {
      return fn(inputs); // no DTensor: a plain call
    }
    if (o.mesh()) {
      DTENSOR_CHECK(*o.mesh() == *mesh, "local_map: the inputs live on {}, the given mesh is {}",
                    mesh->to_string(), o.mesh()->to_string());
    }
    std::vector<at::Tensor> locals;
    {
      detail::LocalRegion region; // [Note: local regions] in interceptors.h
      for (size_t i = 0; i < inputs.size(); ++i) {
        const bool dist = inputs[i].defined() && is_dtensor(inputs[i]);
        locals.push_back(dist ? local_input(inputs[i], i, o) : inputs[i]);
      }
    }
    std::vector<at::Tensor> outputs = fn(locals);
    DTENSOR_CHECK(outputs.size() == o.out_placements().size(),
                  "local_map: the function returned {} tensors, out_placements has {}",
                  outputs.size(), o.out_placements().size());
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (o.out_placements()[i] && outputs[i].defined()) {
        DTENSOR_CHECK(!is_dtensor(outputs[i]),
                      "local_map: output {} of the function is already a DTensor; it must return "
                      "local tensors",
                      i);
        outputs[i] = DTensor::from_local(outputs[i], *mesh, *o.out_placements()[i]);
      }
    }
    return outputs;
  };
}

ImplicitReplication::ImplicitReplication() {
  ++implicit_replication_scopes;
}
ImplicitReplication::~ImplicitReplication() {
  --implicit_replication_scopes;
}
bool implicit_replication_enabled() {
  return implicit_replication_scopes.load() > 0;
}

} // namespace dtensor

namespace dtensor::detail {

namespace {

// Plain tensors of an op with DTensor arguments become Replicate DTensors on their mesh.
OutputFinisher replicate_plain_arguments(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!implicit_replication_enabled()) {
    return nullptr;
  }
  const OpArgs args(op, stack);
  const DeviceMesh* mesh = nullptr;
  args.for_each_tensor([&](size_t, int64_t, const at::Tensor& t) {
    if (const DTensorMeta* m = dtensor_meta(t); m != nullptr && mesh == nullptr) {
      mesh = &m->spec.mesh;
    }
  });
  if (mesh == nullptr) {
    return nullptr;
  }
  const DeviceMesh on = *mesh; // the stack's DTensors may be replaced below
  const Placements replicate(static_cast<size_t>(on.ndim()), Placement::replicate());
  std::vector<std::pair<size_t, int64_t>> plain;
  args.for_each_tensor([&](size_t i, int64_t element, const at::Tensor& t) {
    if (t.defined() && dtensor_meta(t) == nullptr && (t.dim() > 0 || element >= 0)) {
      DTENSOR_CHECK(!args.writes(i),
                    "{}: under ImplicitReplication, argument {} '{}' is a plain tensor the op "
                    "writes into; only DTensors can be written",
                    op.schema().name(), i, args.name_of(i));
      plain.emplace_back(i, element);
    }
  });
  for (const auto& [i, element] : plain) {
    const at::Tensor t =
        element < 0 ? args[i].toTensor() : args[i].toTensorVector()[static_cast<size_t>(element)];
    args.set(i, element,
             make_dtensor(
                 t, make_spec(on, replicate, t.sizes().vec(), t.scalar_type(), t.strides().vec())));
  }
  return nullptr;
}

[[maybe_unused]] const bool implicit_replication_registered = register_interceptor(
    {"implicit replication", /*order=*/30, nullptr, replicate_plain_arguments, wants_plain});

} // namespace

} // namespace dtensor::detail
