#pragma once

// The one checking macro of dtensor (internal: consumers never need fmt).
//
//   DTENSOR_CHECK(dim < ndim, "get_group: dim {} out of range for {}", dim, mesh.to_string());
//
// throws dtensor::Error whose message is the formatted text. Messages name the offending
// values: the op, the placements, the shapes, the mesh, the ranks.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <dtensor/error.h>

#define DTENSOR_CHECK(cond, ...)                                                         \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      throw ::dtensor::Error(::fmt::format(__VA_ARGS__));                                \
    }                                                                                    \
  } while (false)

#define DTENSOR_FAIL(...) throw ::dtensor::Error(::fmt::format(__VA_ARGS__))
