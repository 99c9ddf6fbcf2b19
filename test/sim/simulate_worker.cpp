// One training step of a small tensor-parallel + fully_shard MLP on a (dp, tp) mesh,
// recorded with StepRecorder (dtensor/simulate.h). test/sim/sim_driver.py runs it
//  - for real, under torchrun on Gloo: `simulate_worker real DIR` (each rank writes
//    DIR/rank<R>.json), and
//  - simulated, in one process: `simulate_worker simulate DIR WORLD [broken]` plays every
//    rank of a world of WORLD in turn on the fake backend (init_process_group with backend
//    Fake, tensors of the simulated device), writes the same reports and prints check_plan's
//    findings; `broken` makes rank 1 skip the gradient-norm all-reduce on its dp group (a
//    rank-dependent condition), which the plan check must name.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <dtensor/all.h>

namespace {

using namespace dtensor;

RankReport one_step(int64_t world, bool broken) {
  const int64_t tp = world % 2 == 0 ? 2 : 1;
  const DeviceMesh mesh = init_device_mesh(c10::kCPU, {world / tp, tp}, {"dp", "tp"});
  torch::nn::Sequential mlp{nullptr};
  {
    MetaDeviceGuard meta; // built on meta, as a model larger than one device is
    mlp = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Linear(32, 16));
  }
  parallelize_module(*mlp, mesh["tp"],
                     ParallelizePlan{{"0", std::make_shared<ColwiseParallel>()},
                                     {"1", std::make_shared<RowwiseParallel>()}});
  fully_shard(*mlp, FullyShardOptions().mesh(mesh["dp"]));
  to_empty(*mlp, default_device()); // meta again in the simulated world
  {
    at::NoGradGuard no_grad;
    for (auto& p : mlp->parameters()) {
      p.fill_(0.01); // no values on meta: nothing to do there
    }
  }
  torch::optim::AdamW opt(mlp->parameters(), torch::optim::AdamWOptions(1e-3));
  const at::Tensor x = at::ones({4, 8, 16}, at::TensorOptions().device(default_device()));

  StepRecorder recorder;
  recorder.phase("forward");
  at::Tensor loss = mlp->forward(x).pow(2).mean();
  recorder.phase("backward");
  loss.backward();
  recorder.phase("optimizer");
  if (!(broken && get_rank() == 1)) {
    clip_grad_norm_(mlp->parameters(), 1.0);
  }
  opt.step();
  return recorder.finish(mlp->parameters(), &opt);
}

void write(const std::string& dir, const RankReport& r) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/rank" + std::to_string(r.rank) + ".json") << r.to_json() << "\n";
}

} // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 2 ? argv[1] : "";
  try {
    if (mode == "real") {
      init_process_group();
      write(argv[2], one_step(get_world_size(), false));
      destroy_process_group();
      return 0;
    }
    if (mode == "simulate" && argc > 3) {
      const int world = std::stoi(argv[3]);
      const bool broken = argc > 4 && std::string(argv[4]) == "broken";
      std::vector<RankReport> reports;
      for (int r = 0; r < world; ++r) {
        init_process_group(
            ProcessGroupOptions().backend(BackendType::Fake).world_size(world).rank(r));
        reports.push_back(one_step(world, broken));
        write(argv[2], reports.back());
        destroy_process_group();
      }
      const auto mismatches = check_plan(reports);
      for (const auto& m : mismatches) {
        std::printf("mismatch: %s\n", m.message.c_str());
      }
      std::printf("plan %s\n", mismatches.empty() ? "consistent" : "inconsistent");
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "simulate_worker: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: simulate_worker real DIR | simulate DIR WORLD [broken]\n");
  return 2;
}
