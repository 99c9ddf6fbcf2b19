#pragma once

// Agreeing on an error before any data moves (see [Note: agreeing on errors]).
#include <string>

#include <ATen/core/Tensor.h>
#include <vector>

#include <dtensor/device_mesh.h>
#include <dtensor/process_group.h>

namespace dtensor::detail {

// Collective over `group`: every rank passes the error it found ("" for none). When no
// rank found one, returns (one all-gather of one integer). Otherwise every rank throws the
// same dtensor::Error, "<what>: rank r: <error>; rank s: <error>", naming each failing rank.
void agree_on_errors(const std::string& what, const std::string& error, const Group& group);

// Collective over `group`: every rank's string, in group order (two all-gathers: the
// lengths, then the bytes padded to the longest).
std::vector<std::string> all_gather_strings(const std::string& mine, const Group& group);

// Whether user-sized collectives and from_local without a shape agree on sizes first: yes,
// unless the environment sets DTENSOR_AGREE_SIZES=0 (read once) for a job that trusts its
// inputs as PyTorch does and wants the last microseconds of small collectives back.
bool agree_on_sizes_enabled();

// One integer standing for a tensor's sizes and dtype (FNV-1a), for the fingerprints below.
int64_t shape_fingerprint(c10::IntArrayRef sizes, c10::ScalarType dtype);

// [Note: agreeing on sizes] Collective over `group`: every rank passes a fingerprint of what
// it is about to send and receive (the same number of integers on every rank) and a short
// description of it. One all-gather of both, not counted by CommDebugMode. When `consistent`
// (given every rank's fingerprint, a [group size, n] tensor, the same on every rank; by
// default: all equal) says no, every rank raises the same dtensor::Error, "<what>: the ranks
// of <group> disagree, so nothing was sent: rank 0: <description>; rank 1: ...".
using Consistent = bool (*)(const at::Tensor& fingerprints);
void agree_on_sizes(const std::string& what, const std::vector<int64_t>& fingerprint,
                    const std::string& description, const Group& group,
                    Consistent consistent = nullptr);
// The same over every rank of `mesh` (one all-gather per mesh dimension), for what spans
// the mesh (DTensor::from_local).
void agree_on_sizes(const std::string& what, const std::vector<int64_t>& fingerprint,
                    const std::string& description, const DeviceMesh& mesh);

} // namespace dtensor::detail
