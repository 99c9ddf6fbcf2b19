// The test programs' precompiled header ([Note: precompiled headers] in meson.build): the
// prelude every test includes (Catch2 first, see support/catch.h) and the LibTorch modules
// and optimizers most of them use, parsed once per build instead of once per program.
#include "support/catch.h"
#include "support/dist.h"
#include "support/pieces.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
