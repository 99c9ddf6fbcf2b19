#pragma once

// Helpers the pipelining files share (one home each, defined in action.cpp).
#include <vector>

#include <dtensor/pipeline_schedule.h>

namespace dtensor::detail {

// The actions `a` runs: its sub-actions (OVERLAP_F_B), or itself.
std::vector<PipelineAction> parts_of(const PipelineAction& a);
// Throws unless every action of `order` is a compute action (F, I, W, B, OVERLAP_F_B) or an
// idle step; `what` names the caller in the message.
void check_compute_only(const PipelineOrder& order, const char* what);

} // namespace dtensor::detail
