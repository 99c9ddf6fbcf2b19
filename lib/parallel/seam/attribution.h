#pragma once

// CommDebugMode's module attribution as hooks on the module seam ([Note: module attribution]).
#include <dtensor/module_hooks.h>

namespace dtensor::detail {

// Global hooks, active while a CommDebugMode is: the module is current from its pre-forward
// to its post-forward, and in backward from its outputs' first gradient.
ModuleHooks attribution_hooks();

} // namespace dtensor::detail
