// Agreeing on an error before any data moves.
#include "mesh/agree.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <dtensor/collectives.h>

#include "internal/check.h"
#include "mesh/collective_calls.h"
#include "mesh/collectives_internal.h"
#include "mesh/flight_recorder.h"
#include "mesh/rank_device.h"

namespace dtensor::detail {

namespace {

at::Device device_of(const Group& group) {
  return group.device_type() == c10::DeviceType::CUDA ? rank_device(c10::kCUDA)
                                                      : at::Device(at::kCPU);
}

at::Tensor gather_lengths(const std::string& mine, const Group& group) {
  const at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  return detail::unagreed::all_gather_tensor(len.to(device_of(group)), 0, group).cpu();
}

// Every rank's string, given every rank's length (`lens`, on the CPU).
std::vector<std::string> gather_padded(const std::string& mine, const at::Tensor& lens, const Group& group) {
  const at::Device device = device_of(group);
  const int64_t longest = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  const at::Tensor all =
      detail::unagreed::all_gather_tensor(bytes.to(device), 0, group).cpu().view({-1, longest});
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

namespace {

constexpr int64_t kDescriptionBytes = 256; // a description's room (longer ones are cut)

// This rank's row: the fingerprint, then the description's bytes in int64 words.
at::Tensor row_of(const std::vector<int64_t>& fingerprint, const std::string& description) {
  const auto n = static_cast<int64_t>(fingerprint.size());
  at::Tensor row = at::zeros({n + kDescriptionBytes / 8}, at::kLong);
  std::copy(fingerprint.begin(), fingerprint.end(), row.data_ptr<int64_t>());
  std::memcpy(row.data_ptr<int64_t>() + n, description.data(),
              std::min<size_t>(description.size(), kDescriptionBytes - 1));
  return row;
}

std::string description_in(const at::Tensor& row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row.data_ptr<int64_t>() + n);
  return std::string(bytes, strnlen(bytes, kDescriptionBytes));
}

bool all_equal(const at::Tensor& fingerprints) {
  return fingerprints.eq(fingerprints[0]).all().item<bool>();
}

// Raises unless the gathered rows (one per rank of `ranks`) are consistent.
void judge(const std::string& what, const std::string& where, const at::Tensor& rows, int64_t n,
           const std::vector<int>& ranks, Consistent consistent) {
  const at::Tensor fingerprints = rows.narrow(1, 0, n);
  if ((consistent != nullptr ? consistent : all_equal)(fingerprints)) {
    return;
  }
  std::string message;
  for (int64_t r = 0; r < rows.size(0); ++r) {
    message += fmt::format("{}rank {}: {}", r == 0 ? "" : "; ", ranks[static_cast<size_t>(r)],
                           description_in(rows[r], n));
  }
  const std::string error =
      fmt::format("{}: the ranks of {} disagree, so nothing was sent: {}", what, where, message);
  flight_failure(error);
  DTENSOR_FAIL("{}", error);
}

} // namespace

bool agree_on_sizes_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("DTENSOR_AGREE_SIZES");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

int64_t shape_fingerprint(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t s : sizes) {
    h = (h ^ static_cast<uint64_t>(s)) * 1099511628211ull;
  }
  h = (h ^ sizes.size()) * 1099511628211ull;
  return static_cast<int64_t>((h ^ static_cast<uint64_t>(dtype)) * 1099511628211ull);
}

void agree_on_sizes(const std::string& what, const std::vector<int64_t>& fingerprint,
                    const std::string& description, const Group& group, Consistent consistent) {
  const Uncounted uncounted;
  const FlightAgreement agreement(description);
  const at::Tensor row = row_of(fingerprint, description);
  at::Tensor rows;
  try {
    rows = detail::unagreed::all_gather_tensor(row.to(device_of(group)), 0, group)
               .cpu()
               .view({group.size(), -1});
  } catch (const Error& e) { // a peer that failed or stalls: name the caller's collective
    DTENSOR_FAIL("{} on group {} failed while the ranks agreed on its sizes: {}", description,
                 group.to_string(), e.what());
  }
  judge(what, "group " + group.to_string(), rows, static_cast<int64_t>(fingerprint.size()),
        group.ranks(), consistent);
}

void agree_on_sizes(const std::string& what, const std::vector<int64_t>& fingerprint,
                    const std::string& description, const DeviceMesh& mesh) {
  const Uncounted uncounted;
  const FlightAgreement agreement(description);
  // Gathered over the last dimension first, then stacked in front over each earlier one:
  // the rows end up row-major over the mesh, as mesh.ranks().
  at::Tensor rows = row_of(fingerprint, description).unsqueeze(0);
  for (int64_t d = mesh.ndim() - 1; d >= 0; --d) {
    const Group group = mesh.get_group(d);
    try {
      rows = detail::unagreed::all_gather_tensor(rows.to(device_of(group)).unsqueeze(0), 0, group)
                 .cpu()
                 .view({-1, rows.size(1)});
    } catch (const Error& e) {
      DTENSOR_FAIL("{}: {} failed while the ranks agreed on sizes: {}", what, description, e.what());
    }
  }
  judge(what, "mesh " + mesh.to_string(), rows, static_cast<int64_t>(fingerprint.size()),
        mesh.ranks(), nullptr);
}

} // namespace dtensor::detail

namespace dtensor {

namespace {
// The message `body` threw ("" when it returned).
std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    const std::string error = e.what();
    return error.empty() ? "an exception without a message" : error;
  }
  return "";
}
} // namespace

void on_rank0(const std::string& what, const std::function<void()>& body, const Group& group) {
  detail::agree_on_errors(what, group.rank() == 0 ? error_of(body) : std::string(), group);
}

void on_every_rank(const std::string& what, const std::function<void()>& body,
                   const Group& group) {
  detail::agree_on_errors(what, error_of(body), group);
}

} // namespace dtensor
