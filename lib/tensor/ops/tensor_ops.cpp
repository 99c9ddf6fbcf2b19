// Ops that keep their input's layout: copies, detach, *_like factories, fills, casts, item.
#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

// Output (and every DTensor input) keeps the first DTensor argument's placements.
OpSharding same_as_self(const OpInfo& info) {
  OpSharding s;
  s.inputs.resize(info.num_args());
  const DTensorSpec& self = *info.specs[0];
  s.outputs.push_back(self.placements);
  for (size_t i = 1; i < info.num_args(); ++i) {
    if (info.specs[i]) {
      s.inputs[i] = self.placements;
    }
  }
  return s;
}

// Factories that only take the input's metadata: a Partial input gives a Replicate output
// (the new values are not partial sums).
OpSharding like_factory(const OpInfo& info) {
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.outputs.push_back(without_partial(info.specs[0]->placements));
  return s;
}

// fill_ / zero_ write the same value everywhere: fine for Shard / Replicate, wrong for a
// Partial(sum) (the reduction would multiply it).
OpSharding fill_rule(const OpInfo& info) {
  for (const auto& p : info.specs[0]->placements) {
    if (p.is_partial() && p.reduce_op() == ReduceOp::Sum && !p.is_norm_partial()) {
      fail_unsupported(info, "filling a Partial(sum) DTensor in place would change its value; "
                             "redistribute it to Replicate first");
    }
  }
  return same_as_self(info);
}

// fill(self, value): a new tensor of self's shape holding value everywhere: self's shards,
// never Partial (each rank holds the value itself); a DTensor value (0-dim) is Replicate.
OpSharding fill_functional_rule(const OpInfo& info) {
  OpSharding s = like_factory(info);
  if (info.num_args() > 1 && info.specs[1]) {
    s.inputs[1] = replicate_all(info.mesh_ndim());
  }
  return s;
}

// [Note: _to_copy with a device] A dtype cast often names the device it stays on (autograd
// casting a gradient back to its input's dtype passes the full TensorOptions): a device of
// the mesh's type is that one. Another device type would move the local shard off the mesh.
OpSharding to_copy_rule(const OpInfo& info) {
  const c10::DeviceType mesh_type = info.specs[0]->mesh.device_type();
  for (size_t i = 1; i < info.num_args(); ++i) {
    const c10::IValue& v = info.arg(i);
    if (v.isDevice() && v.toDevice().type() != mesh_type) {
      fail_unsupported(info,
                       "moving a DTensor to another device is not supported; the mesh fixes it");
    }
  }
  OpSharding s = same_as_self(info);
  // A cast to an integer or bool type does not commute with a partial sum (each piece would
  // be rounded): the input is reduced first. Among floating types it does, up to rounding.
  const auto& args = info.op->schema().arguments();
  for (size_t i = 1; i < info.num_args() && i < args.size(); ++i) {
    if (args[i].name() == "dtype" && info.arg(i).isInt() &&
        !c10::isFloatingType(static_cast<c10::ScalarType>(info.arg(i).toInt()))) {
      s.inputs[0] = without_partial(info.specs[0]->placements);
      s.outputs[0] = *s.inputs[0];
    }
  }
  return s;
}

// new_empty / new_zeros / new_ones / new_full / new_empty_strided(self, size, [stride,] ...):
// a new tensor of the given global size. Same shape as self: self's layout (Partial ->
// Replicate); another shape: Replicate.
OpSharding new_factory(const OpInfo& info) {
  const DTensorSpec& self = *info.specs[0];
  std::vector<int64_t> size = info.arg(1).toIntVector();
  Placements out =
      size == self.shape ? without_partial(self.placements) : replicate_all(info.mesh_ndim());
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.outputs.push_back(out); // size (and stride) become local: [Note: shape arguments]
  return s;
}

} // namespace

void register_tensor_ops() {
  for (const char* name : {"aten::new_empty", "aten::new_zeros", "aten::new_ones", "aten::new_full",
                           "aten::new_empty_strided"}) {
    register_rule(name, new_factory);
  }
  for (const char* name : {"aten::clone", "aten::detach", "aten::alias", "aten::copy_",
                           "aten::copy", "aten::lift_fresh", "aten::_copy_from"}) {
    register_rule(name, same_as_self);
  }
  for (const char* name :
       {"aten::zeros_like", "aten::ones_like", "aten::empty_like", "aten::full_like"}) {
    register_rule(name, like_factory);
  }
  register_rule("aten::fill_", fill_rule);
  register_rule("aten::fill", fill_functional_rule);
  register_rule("aten::zero_", same_as_self); // zeros stay zero under any reduction
  register_rule("aten::_to_copy", to_copy_rule);
  register_rule("aten::_local_scalar_dense", all_replicate); // item(): the whole value
  register_rule("aten::equal", all_replicate);
  register_rule("aten::is_nonzero", all_replicate);
}

} // namespace dtensor::detail
