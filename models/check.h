#pragma once

// The models' one check: a bad configuration or input raises dtensor::Error, the one error
// type the library promises its users (include/dtensor/error.h), with the same message on
// every rank (the checks depend only on what every rank was given).
//
//   DTENSOR_MODEL_CHECK(dim % heads == 0, "Llama3: dim ", dim, " is not a multiple of ", heads);
#include <c10/util/StringUtil.h>

#include <dtensor/error.h>

#define DTENSOR_MODEL_CHECK(cond, ...)                                                   \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      throw ::dtensor::Error(::c10::str(__VA_ARGS__));                                   \
    }                                                                                    \
  } while (false)
