// Agreeing on an error before any data moves.
#include "mesh/agree.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include <dtensor/collectives.h>

#include "internal/check.h"

namespace dtensor::detail {

namespace {

at::Device device_of(const Group& group) {
  return group.device_type() == c10::DeviceType::CUDA
             ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(get_local_rank()))
             : at::Device(at::kCPU);
}

at::Tensor gather_lengths(const std::string& mine, const Group& group) {
  const at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  return all_gather_tensor(len.to(device_of(group)), 0, group).cpu();
}

// Every rank's string, given every rank's length (`lens`, on the CPU).
std::vector<std::string> gather_padded(const std::string& mine, const at::Tensor& lens, const Group& group) {
  const at::Device device = device_of(group);
  const int64_t longest = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  const at::Tensor all = all_gather_tensor(bytes.to(device), 0, group).cpu().view({-1, longest});
  std::vector<std::string> out;
  for (int64_t r = 0; r < all.size(0); ++r) {
    out.emplace_back(reinterpret_cast<const char*>(all[r].data_ptr()),
                     static_cast<size_t>(lens[r].item<int64_t>()));
  }
  return out;
}

} // namespace

std::vector<std::string> all_gather_strings(const std::string& mine, const Group& group) {
  return gather_padded(mine, gather_lengths(mine, group), group);
}

// [Note: agreeing on errors]
// An error found on some ranks only, before a collective, leaves the others waiting in
// that collective until it times out (or aborts them when the collective then runs with
// mismatched sizes). Validation that can differ between ranks therefore ends in one small
// all-gather of the error lengths; if any rank failed, the messages are gathered too, and
// every rank raises the same error naming every failing rank, before any data moved.
void agree_on_errors(const std::string& what, const std::string& error, const Group& group) {
  const at::Tensor lens = gather_lengths(error, group);
  if (lens.max().item<int64_t>() == 0) {
    return;
  }
  const std::vector<std::string> errors = gather_padded(error, lens, group);
  std::string message;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) {
      message += fmt::format("{}rank {}: {}", message.empty() ? "" : "; ", group.ranks()[r], errors[r]);
    }
  }
  DTENSOR_FAIL("{}: {}", what, message);
}

} // namespace dtensor::detail

namespace dtensor {

void on_rank0(const std::string& what, const std::function<void()>& body, const Group& group) {
  std::string error;
  if (group.rank() == 0) {
    try {
      body();
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) {
        error = "an exception without a message";
      }
    }
  }
  detail::agree_on_errors(what, error, group);
}

} // namespace dtensor
