#pragma once

// Helpers shared by the benchmark programs that run beside a Python driver (bench/*.py):
// bench/live_bytes.cpp's counters when it is preloaded, and the JSON of a RESULT line.
#include <dlfcn.h>

#include <algorithm>
#include <string>
#include <vector>

namespace bench {

// bench/live_bytes.cpp's counter `name` when it is preloaded (LD_PRELOAD), else null.
template <typename F>
F* live_bytes_fn(const char* name) {
  return reinterpret_cast<F*>(dlsym(RTLD_DEFAULT, name));
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

inline std::string json_list(const std::vector<double>& v) {
  std::string out;
  for (double x : v) {
    out += (out.empty() ? "" : ", ") + std::to_string(x);
  }
  return "[" + out + "]";
}

} // namespace bench
