#pragma once

// PyTorch's register_sharding (torch.distributed.tensor.experimental) in C++: a user
// function that lists the shardings an op accepts, for an op dtensor has no rule for (a
// custom op, a kernel of your own) or to replace dtensor's rule for one it has.
// docs/dtensor.md, "User code".
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include <dtensor/dtensor_spec.h>
#include <dtensor/placement.h>

namespace dtensor {

// What a sharding function sees: the op's arguments in schema order (defaults filled in),
// and for each DTensor argument its spec (global shape, dtype, placements, mesh).
struct ShardingArgs {
  std::vector<c10::IValue> values;
  std::vector<std::optional<DTensorSpec>> specs;
};

// One sharding the op accepts on one mesh dimension: a placement for each returned tensor
// and for each argument (nullopt for arguments that are not tensors), as PyTorch's
// (output_placements, input_placements) pairs.
struct AcceptableSharding {
  std::vector<std::optional<Placement>> outputs;
  std::vector<std::optional<Placement>> inputs;
};
using ShardingFn = std::function<std::vector<AcceptableSharding>(const ShardingArgs&)>;

// Registers `fn` for `op` ("ns::name" for every overload, "ns::name.overload" for one),
// replacing dtensor's own rule while registered. Each mesh dimension takes one of the
// acceptable shardings; of all combinations that fit the inputs (a Shard within each
// input's dims) the one moving the fewest elements from the inputs' current placements is
// used (ties: the earlier in fn's list), the inputs are redistributed to it and the local op
// runs. As in PyTorch, the op's outputs' global shapes come from its meta kernel (or, for
// outputs that are not sharded, its local result). Errors name the op: an unknown op, a
// sharding whose lists do not match the op's schema, none that fits. A custom op whose
// kernel is CompositeExplicitAutograd is routed to dtensor's handler from then on (before,
// its kernel ran on the DTensors). Register and unregister before other threads run ops
// on DTensors (the rule table is not locked for them). With LibTorch 2.9.1 a custom op also
// needs an autograd kernel, or a fallthrough for AutogradPrivateUse1, to reach DTensors
// (2.15 has an autograd fallback there).
void register_sharding(const std::string& op, ShardingFn fn);
// Removes the function registered for `op`; dtensor's own rule (if any) applies again.
void unregister_sharding(const std::string& op);

} // namespace dtensor
