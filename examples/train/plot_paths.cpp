#include "plot_paths.h"

namespace dtensor::train {

const char* plot_python() {
  return DTENSOR_PLOT_PYTHON;
}

const char* plot_script() {
  return DTENSOR_PLOT_SCRIPT;
}

} // namespace dtensor::train
