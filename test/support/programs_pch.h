// The precompiled header of the programs without Catch2 ([Note: precompiled headers] in
// meson.build): the test drivers and workers, the conformance suite's dtensor side (at -O0)
// and the benchmarks (at -O2, their own copy): LibTorch, its modules and optimizers, and
// dtensor's public headers, which all of them include.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dtensor/all.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
