// Construction of c10d::ProcessGroupGloo. The only translation unit that sees the Gloo
// headers (Debian's libgloo-dev: headers only; the Gloo code itself is inside libtorch_cpu).
#include <cstdlib>
#include <sstream>
#include <string>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp>

#include "internal/check.h"
#include "mesh/process_group_state.h"

namespace dtensor::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // Same rule as PyTorch: GLOO_SOCKET_IFNAME (comma-separated interfaces) when set,
  // otherwise the address this host's name resolves to (loopback as a last resort).
  if (const char* ifnames = std::getenv("GLOO_SOCKET_IFNAME"); ifnames && *ifnames) {
    std::stringstream ss(ifnames);
    std::string ifname;
    while (std::getline(ss, ifname, ',')) {
      if (!ifname.empty()) {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      }
    }
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  options->threads = static_cast<int>(options->devices.size()) * 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

// [Note: TORCH_DISTRIBUTED_DEBUG=DETAIL]
// As in PyTorch, every backend is wrapped in c10d's ProcessGroupWrapper, which before each
// collective checks on a separate Gloo group (its own store prefix) that every rank of the
// group arrived (a monitored barrier names the missing ranks) and runs the same collective
// with the same tensor shapes, dtypes and devices (fingerprints all-gathered and compared).
// A mismatch raises the same error on every rank before any data moves. It costs two extra
// small Gloo collectives per collective (not counted by CommDebugMode, which sees only
// dtensor's own).
c10::intrusive_ptr<c10d::Backend> wrap_for_debug(const c10::intrusive_ptr<c10d::Backend>& backend,
                                                 const c10::intrusive_ptr<c10d::Store>& store,
                                                 int rank, int size,
                                                 std::chrono::milliseconds timeout) {
  auto helper = make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("debug_wrapper/", store),
                                  rank, size, timeout);
  return c10::make_intrusive<c10d::ProcessGroupWrapper>(backend, helper);
}

} // namespace dtensor::detail
