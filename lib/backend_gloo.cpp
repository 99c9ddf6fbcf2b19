// Construction of c10d::ProcessGroupGloo. The only translation unit that sees the Gloo
// headers (Debian's libgloo-dev: headers only; the Gloo code itself is inside libtorch_cpu).
#include <cstdlib>
#include <sstream>
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "internal/check.h"
#include "internal/process_group_state.h"

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

} // namespace dtensor::detail
