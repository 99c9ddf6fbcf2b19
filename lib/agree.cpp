// Agreeing on an error before any data moves.
#include "internal/agree.h"

#include <ATen/ATen.h>

#include <cstring>

#include <dtensor/collectives.h>

#include "internal/check.h"

namespace dtensor::detail {

// [Note: agreeing on errors]
// An error found on some ranks only, before a collective, leaves the others waiting in
// that collective until it times out (or aborts them when the collective then runs with
// mismatched sizes). Validation that can differ between ranks therefore ends in one small
// all-gather of the error lengths; if any rank failed, the messages are gathered too, and
// every rank raises the same error naming every failing rank, before any data moved.
void agree_on_errors(const std::string& what, const std::string& error, const Group& group) {
  const at::Device device = group.device_type() == c10::DeviceType::CUDA
                                ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(get_local_rank()))
                                : at::Device(at::kCPU);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor len = at::full({1}, static_cast<int64_t>(error.size()), opts);
  at::Tensor lens = all_gather_tensor(len, 0, group).cpu();
  const int64_t longest = lens.max().item<int64_t>();
  if (longest == 0) {
    return;
  }
  at::Tensor mine = at::zeros({longest}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(mine.data_ptr(), error.data(), error.size());
  at::Tensor all = all_gather_tensor(mine.to(device), 0, group).cpu().view({-1, longest});
  std::string message;
  for (int64_t r = 0; r < all.size(0); ++r) {
    int64_t n = lens[r].item<int64_t>();
    if (n == 0) {
      continue;
    }
    std::string text(reinterpret_cast<const char*>(all[r].data_ptr()), static_cast<size_t>(n));
    message += fmt::format("{}rank {}: {}", message.empty() ? "" : "; ",
                           group.ranks()[static_cast<size_t>(r)], text);
  }
  DTENSOR_FAIL("{}: {}", what, message);
}

} // namespace dtensor::detail
