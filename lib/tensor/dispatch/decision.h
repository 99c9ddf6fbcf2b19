#pragma once

// The handler's decision for an op (lib/tensor/dispatch/dispatch.cpp's step 3): the rule's
// shardings, the outputs' global geometry and the input redistribution plans, cached by
// op and argument specs ([Note: decision keys] in decision.cpp); the output geometry helpers
// in output_geometry.cpp.
#include <atomic>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tensor/ops/rule.h"
#include "tensor/redistribute/redistribute.h"

namespace dtensor::detail {

struct Cached { // one decision
  OpSharding sharding;
  // No meta kernel and no shapes from the rule, but no output is sharded: every output's
  // global shape is its local shape.
  bool shapes_from_local = false;
  // Per returned tensor (a list return counts once): the global shapes of the outputs.
  std::vector<std::vector<std::vector<int64_t>>> out_shapes;
  // The same for their global strides, when the meta run gave them (empty otherwise: the
  // strides then follow the local result's layout: [Note: global strides]).
  std::vector<std::vector<std::vector<int64_t>>> out_strides;
  // No rule: the op runs its composite kernel ([Note: the decomposition fallback]).
  bool decompose = false;
  // Per argument: the redistribution plan to the placements the rule wants (empty: none),
  // a function of the decision's key, so kept with it: a hit looks up nothing else.
  std::vector<std::vector<TransformStep>> input_plans;
  // Set once this rank's local results of the decision matched their specs' local shapes:
  // the same key gives the same local shapes, so later hits skip the check (wrap_outputs).
  mutable std::atomic<bool> outputs_checked{false};
};

// The decision for `info`: from the cache, or made (rule, shapes, plans) and cached.
std::shared_ptr<const Cached> decide(const c10::OperatorHandle& op, const OpInfo& info);

// Output geometry (output_geometry.cpp): the op run on meta tensors of the global shapes,
// and the spec of output `r` (element `element` of a list output) over local result `local`.
void infer_output_shapes(const c10::OperatorHandle& op, const OpInfo& info, Cached& out);
DTensorSpec output_spec(const OpInfo& info, const Cached& decision, size_t r, size_t element,
                        const at::Tensor& local);

} // namespace dtensor::detail
