#pragma once

// The choke point's side of CommDebugMode (include/dtensor/comm_debug_mode.h), and the hooks
// the layers above report modules and DTensor operations through: not for users.
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <dtensor/comm_debug_mode.h>

namespace dtensor::detail {

// Whether any CommDebugMode is active on this thread (skip building records otherwise).
bool comm_debug_active();
// Adds `rec` to every CommDebugMode active on this thread, its issued_at read from the issue
// stamp when one is set.
void record_collective(const CollectiveRecord& rec);
// The count a StepRecorder stamps collectives with (its kernel FLOPs so far; lib/sim sets it
// while it counts, nullptr clears it).
using IssueStamp = int64_t (*)();
void set_issue_stamp(IssueStamp stamp);
// [Note: waits on the timeline] The records the last record_collective on this thread added
// (one per active CommDebugMode), taken by the choke point for an asynchronous collective,
// and stamped with the issue stamp when its Work is waited on.
struct RecordMark {
  std::weak_ptr<CommDebugMode::Log> log;
  size_t index = 0;
  int64_t issued_at = 0;
};
std::vector<RecordMark> take_record_marks();
void record_wait(const std::vector<RecordMark>& marks);

// --- [Note: module attribution] -----------------------------------------------------------
// A module's forward begins (the attribution hooks of the module seam): its name as PyTorch prints
// it, its type, its own parameters (name, PyTorch's placements text or "" for a plain one, the
// tensor).
struct ModuleForward {
  std::string name;
  std::string type;
  std::vector<std::tuple<std::string, std::string, at::Tensor>> parameters;
};
void module_forward_begin(const ModuleForward& module);
void module_forward_end();
// The gradient of one of the module's outputs arrived (PyTorch's backward pre-hook).
void module_backward_begin(const std::string& name);

// A DTensor operation as PyTorch's CommDebugMode lists it: "aten.mm.default", and per DTensor
// argument its shape ("torch.Size([4, 16])") and placements ("(Shard(dim=1),)"), and the mesh.
struct OpRecord {
  std::string name;
  std::vector<std::string> input_shape;
  std::vector<std::string> input_sharding;
  std::string device_mesh;
  bool is_bw = false;
  bool is_activation_checkpointing = false;
};
void record_dtensor_op(OpRecord op);

// Whether autograd's engine is running a backward on this thread (PyTorch's ModTracker.is_bw).
bool in_autograd_backward();

} // namespace dtensor::detail
