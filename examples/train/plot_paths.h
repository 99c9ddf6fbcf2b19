#pragma once

namespace dtensor::train {

// The Python the build was configured with and scripts/plot_simulation.py, by absolute path
// (they name the clone: plot_paths.cpp is the one object of `train` that differs between
// clones, so ccache serves the others to every clean clone).
const char* plot_python();
const char* plot_script();

} // namespace dtensor::train
