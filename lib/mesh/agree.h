#pragma once

// Agreeing on an error before any data moves (see [Note: agreeing on errors]).
#include <string>
#include <vector>

#include <dtensor/process_group.h>

namespace dtensor::detail {

// Collective over `group`: every rank passes the error it found ("" for none). When no
// rank found one, returns (one all-gather of one integer). Otherwise every rank throws the
// same dtensor::Error, "<what>: rank r: <error>; rank s: <error>", naming each failing rank.
void agree_on_errors(const std::string& what, const std::string& error, const Group& group);

// Collective over `group`: every rank's string, in group order (two all-gathers: the
// lengths, then the bytes padded to the longest).
std::vector<std::string> all_gather_strings(const std::string& mine, const Group& group);

} // namespace dtensor::detail
