#pragma once

// Selective activation checkpointing's op mode ([Note: selective checkpointing as a
// dispatch mode] in selective.cpp): in forward, the outputs of the ops the policy saves are
// kept; in the recompute, those ops return them instead of running again.
#include <memory>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <dtensor/activation_checkpoint.h>

namespace dtensor::detail {

// One checkpointed call's saved outputs, in the order forward ran the ops.
struct SavedOps {
  struct Entry {
    c10::OperatorName op;
    std::vector<c10::IValue> outputs;
  };
  std::vector<Entry> entries;
  size_t next = 0; // the recompute's position
};

struct SelectiveMode;

// While alive on this thread, the ops run record into `saved` the outputs of those
// `policy` saves.
class SelectiveRecordGuard {
 public:
  SelectiveRecordGuard(const CheckpointPolicyFn& policy, SavedOps& saved);
  ~SelectiveRecordGuard();
  SelectiveRecordGuard(const SelectiveRecordGuard&) = delete;
  SelectiveRecordGuard& operator=(const SelectiveRecordGuard&) = delete;

 private:
  std::unique_ptr<SelectiveMode> mode_;
};

// While alive on this thread, the ops `policy` saves return their saved outputs, in order
// (checked: the same ops as in forward).
class SelectiveReplayGuard {
 public:
  SelectiveReplayGuard(const CheckpointPolicyFn& policy, SavedOps& saved);
  ~SelectiveReplayGuard();
  SelectiveReplayGuard(const SelectiveReplayGuard&) = delete;
  SelectiveReplayGuard& operator=(const SelectiveReplayGuard&) = delete;
  // Checks that the recompute used every saved output (else the function ran other ops).
  void finish();

 private:
  std::unique_ptr<SelectiveMode> mode_;
};

} // namespace dtensor::detail
