// The module seam's cost per call (dtensor/module_hooks.h): a small Linear called as
// module->forward(x), through dtensor::call with no active hook (CommDebugMode's global hooks
// sit out), and through dtensor::call with one registered no-op pre-forward hook (the slow
// path: the hooks' nested run). Alternating, best of 7 x 20,000 calls each, us per call.
#include <algorithm>
#include <chrono>
#include <cstdio>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/linear.h>

#include <dtensor/module_hooks.h>

#include "flags.h"

namespace {

using Clock = std::chrono::steady_clock;

// Microseconds per call of f, over `iters` calls.
template <typename F>
double us_per_call(F&& f) {
  const int iters = 20000;
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    f();
  }
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
}

} // namespace

int main(int argc, char** argv) {
  // No flags: --help prints the usage line, anything else is refused.
  dtensor::cli::FlagTable("bench_module_call", "bench/module_call.cpp").parse(argc, argv);
  at::set_num_threads(1);
  torch::NoGradGuard no_grad; // the call's cost, not autograd's
  torch::nn::Linear plain(8, 8), hooked(8, 8);
  auto handle =
      dtensor::register_module_hooks(*hooked, dtensor::ModuleHooks().name("no-op").pre_forward(
                                                  [](torch::nn::Module&, dtensor::TensorList&) {}));
  const at::Tensor x = at::randn({4, 8});
  // The three alternate, 7 rounds; the best of each (the machine's noise only adds).
  double forward = 1e30, call = 1e30, with_hook = 1e30;
  for (int round = 0; round < 7; ++round) {
    forward = std::min(forward, us_per_call([&] { (void)plain->forward(x); }));
    call = std::min(call, us_per_call([&] { (void)dtensor::call(plain, x); }));
    with_hook = std::min(with_hook, us_per_call([&] { (void)dtensor::call(hooked, x); }));
  }
  std::printf("| measure (Linear 8 -> 8 on [4, 8], no grad) | us per call |\n| --- | ---: |\n");
  std::printf("| module->forward(x) | %.2f |\n", forward);
  std::printf("| dtensor::call(module, x), no active hook | %.2f (+%.2f) |\n", call,
              call - forward);
  std::printf("| dtensor::call(module, x), one no-op pre-forward hook | %.2f (+%.2f) |\n",
              with_hook, with_hook - forward);
  return 0;
}
