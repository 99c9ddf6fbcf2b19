#pragma once

#include <stdexcept>
#include <string>

namespace dtensor {

// The one exception type dtensor throws for bad input and failed collectives. Its message
// names the offending values (op, placements, shapes, mesh, ranks). Errors that LibTorch
// or c10d raise underneath (c10::Error) are caught at the collective choke point and
// re-thrown as dtensor::Error with the collective and group added.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

} // namespace dtensor
