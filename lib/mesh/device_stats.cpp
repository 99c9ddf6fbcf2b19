// The peak throughput table of dtensor/device_stats.h ([Note: device figures]).
#include <dtensor/device_stats.h>

#include <vector>

namespace dtensor {

double peak_tflops(const std::string& name, bool fp8) {
  struct Peak {
    const char* match; // a part of the device's name; the first row that matches wins
    double bf16, fp8;  // dense TFLOPs (the datasheets' sparse figures halved)
  };
  // GB200 before B200 and H100's variants before H100: a name holds the shorter one too.
  static const std::vector<Peak> table{
      {"GB200", 2500, 5000},    {"B200", 2250, 4500}, {"H200", 989, 1979}, {"H100 NVL", 835, 1671},
      {"H100 PCIe", 756, 1513}, {"H100", 989, 1979},  {"A100", 312, 0},
  };
  for (const Peak& p : table) {
    if (name.find(p.match) != std::string::npos) {
      return fp8 ? p.fp8 : p.bf16;
    }
  }
  return 0;
}

} // namespace dtensor
