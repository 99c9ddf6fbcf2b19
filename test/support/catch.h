#pragma once

// Catch2 v2 (Debian's catch2 package) and v3 (the subprojects/ wrap) behind one include.
//
// c10/util/Logging.h defines a glog-style CHECK macro that silently replaces Catch2's
// CHECK when it is included later (an assertion that counts nothing). Include it first and
// drop its CHECK, so every test file gets Catch2's whatever it includes afterwards.
#include <c10/util/Logging.h>
#undef CHECK
#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#define DTENSOR_CATCH_V3 1
namespace dtensor::testing {
inline auto contains(const std::string& s) { return Catch::Matchers::ContainsSubstring(s); }
} // namespace dtensor::testing
#else
#include <catch2/catch.hpp>
#define DTENSOR_CATCH_V3 0
namespace dtensor::testing {
inline auto contains(const std::string& s) { return Catch::Matchers::Contains(s); }
} // namespace dtensor::testing
#endif
