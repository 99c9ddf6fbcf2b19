// Ops over lists of tensors: cat, stack, split / split_with_sizes, unbind.
#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

// cat(tensors, dim): every input takes the first input's placements, with the cat dim
// (and Partial) replicated. Inputs of rank 1 and size 0 are legacy no-ops of cat.
// The placements every element of a cat / stack takes: per mesh dim, the first element's
// Shard on a dim other than `whole_dim` if any element has one (Replicate elements are cut
// locally, no communication), else Replicate (Partial elements are reduced).
Placements common_shards(const std::vector<DTensorSpec>& specs, int64_t whole_dim) {
  Placements p(specs[0].placements.size(), Placement::replicate());
  for (size_t i = 0; i < p.size(); ++i) {
    for (const auto& spec : specs) {
      const Placement& x = spec.placements[i];
      if (x.is_shard() && x.dim() != whole_dim) {
        p[i] = x;
        break;
      }
    }
  }
  return p;
}

OpSharding cat_rule(const OpInfo& info) {
  const auto& specs = info.list_specs[0];
  if (specs.empty()) {
    fail_unsupported(info, "cat of an empty list");
  }
  int64_t ndim = specs[0].ndim();
  int64_t dim = wrap_dim(info.num_args() > 1 ? info.arg(1).toInt() : 0, ndim);
  const Placements p = common_shards(specs, dim);
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.list_inputs.resize(info.num_args());
  s.list_inputs[0] = p;
  s.outputs.push_back(p);
  return s;
}

// stack(tensors, dim): like cat on a new dim; shards at or after it move up by one.
OpSharding stack_rule(const OpInfo& info) {
  const auto& specs = info.list_specs[0];
  if (specs.empty()) {
    fail_unsupported(info, "stack of an empty list");
  }
  int64_t dim = wrap_dim(info.num_args() > 1 ? info.arg(1).toInt() : 0, specs[0].ndim() + 1);
  const Placements in = common_shards(specs, /*whole_dim=*/-1);
  Placements out;
  for (const auto& y : in) {
    out.push_back(y.is_shard() && y.dim() >= dim ? Placement::shard(y.dim() + 1) : y);
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.list_inputs.resize(info.num_args());
  s.list_inputs[0] = in;
  s.outputs.push_back(out);
  return s;
}

// split.Tensor(self, split_size, dim) / split_with_sizes(self, sizes, dim): the split dim
// must be whole; every piece keeps the other placements.
OpSharding split_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  int64_t dim = wrap_dim(info.num_args() > 2 ? info.arg(2).toInt() : 0, in.ndim());
  Placements p;
  for (const auto& x : in.placements) {
    p.push_back(x.is_shard(dim) ? Placement::replicate() : x);
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = p;
  s.outputs.push_back(p);
  return s;
}

// unbind(self, dim): the dim disappears; shards after it move down by one.
OpSharding unbind_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  int64_t dim = wrap_dim(info.num_args() > 1 ? info.arg(1).toInt() : 0, in.ndim());
  Placements want;
  Placements out;
  for (const auto& x : in.placements) {
    Placement y = x.is_shard(dim) ? Placement::replicate() : x;
    want.push_back(y);
    out.push_back(y.is_shard() && y.dim() > dim ? Placement::shard(y.dim() - 1) : y);
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = want;
  s.outputs.push_back(out);
  return s;
}

} // namespace

void register_list_ops() {
  register_rule("aten::cat", cat_rule);
  register_rule("aten::stack", stack_rule);
  register_rule("aten::split.Tensor", split_rule);
  register_rule("aten::split_with_sizes", split_rule);
  register_rule("aten::unbind", unbind_rule);
}

} // namespace dtensor::detail
