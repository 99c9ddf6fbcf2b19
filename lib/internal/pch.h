// The library's precompiled header ([Note: precompiled headers] in meson.build): the
// LibTorch, c10d and third-party headers most of lib/'s units include, parsed once per build
// instead of once per unit. Only headers that do not change with dtensor's own code belong
// here (a dtensor header would rebuild every unit whenever it changes); each unit still
// includes what it uses, which the builds without a precompiled header check.
#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/library.h>
#include <torch/nn/module.h>
