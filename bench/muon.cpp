// Muon's optimizer step against AdamW's on the same layout (bench/muon.py drives it beside
// torch.optim.Muon on one process): the matrices of --layers Llama-like blocks (wq, wk, wv, wo
// [D, D]; w1, w3 [F, D]; w2 [D, F]) by Muon, two norms a block by AdamW, every parameter
// Shard(0) over all ranks (FSDP's layout), fixed random gradients. Per round: --steps AdamW
// steps then --steps Muon steps, each timed from a barrier; rank 0 prints one RESULT line
// (JSON) with the medians, the all-to-alls and bytes (mean over ranks) of one Muon step.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dtensor/all.h>

#include "bench_util.h"
#include "flags.h"

namespace {

struct Args {
  int64_t dim = 256, layers = 2, steps = 5, rounds = 3;
};

Args parse(int argc, char** argv) {
  Args a;
  dtensor::cli::FlagTable("bench_muon", "bench/muon.cpp")
      .value("--dim", "model width (256)", a.dim)
      .value("--layers", "blocks (2)", a.layers)
      .value("--steps", "timed steps of each optimizer per round (5)", a.steps)
      .value("--rounds", "rounds (3)", a.rounds)
      .parse(argc, argv);
  return a;
}

using Params = std::vector<std::pair<std::string, at::Tensor>>;

Params make_params(const Args& a, const dtensor::DeviceMesh& mesh) {
  const int64_t d = a.dim;
  const int64_t f = 3 * d;
  Params out;
  at::manual_seed(0);
  for (int64_t l = 0; l < a.layers; ++l) {
    const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
        {"wq", {d, d}}, {"wk", {d, d}}, {"wv", {d, d}},          {"wo", {d, d}},   {"w1", {f, d}},
        {"w3", {f, d}}, {"w2", {d, f}}, {"attention_norm", {d}}, {"ffn_norm", {d}}};
    for (const auto& [name, shape] : shapes) {
      at::Tensor p = dtensor::distribute_tensor(at::randn(shape) * 0.02, mesh, {dtensor::Shard(0)},
                                                std::nullopt);
      p.set_requires_grad(true);
      p.mutable_grad() =
          dtensor::distribute_tensor(at::randn(shape), mesh, {dtensor::Shard(0)}, std::nullopt);
      out.emplace_back(std::to_string(l) + "." + name, p);
    }
  }
  return out;
}

std::vector<torch::optim::OptimizerParamGroup> groups(const Params& params, bool muon) {
  std::vector<at::Tensor> matrices;
  std::vector<at::Tensor> others;
  for (const auto& [name, p] : params) {
    (muon && p.dim() == 2 ? matrices : others).push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> out;
  out.emplace_back(matrices, std::make_unique<dtensor::optim::MuonOptions>(0.02));
  out.emplace_back(others, std::make_unique<torch::optim::AdamWOptions>(
                               torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95})));
  return out;
}

// Median seconds of `steps` optimizer steps, each from a barrier.
double time_steps(torch::optim::Optimizer& opt, int64_t steps) {
  std::vector<double> t;
  for (int64_t s = 0; s < steps; ++s) {
    dtensor::barrier(dtensor::world_group());
    const auto start = std::chrono::steady_clock::now();
    opt.step();
    dtensor::barrier(dtensor::world_group());
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return bench::median(t);
}

} // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  const Args a = parse(argc, argv);
  dtensor::init_process_group();
  const int world = dtensor::get_world_size();
  const auto mesh = dtensor::init_device_mesh(c10::kCPU, {world}, {"dp"});
  Params params = make_params(a, mesh);
  dtensor::optim::Muon adamw(groups(params, false));
  dtensor::optim::Muon muon(groups(params, true));
  std::vector<double> adamw_s, muon_s;
  for (int64_t r = 0; r < a.rounds; ++r) {
    adamw_s.push_back(time_steps(adamw, a.steps));
    muon_s.push_back(time_steps(muon, a.steps));
  }
  dtensor::CommDebugMode mode;
  muon.step();
  int64_t elements = 0;
  for (const auto& [name, p] : params) {
    elements += p.dim() == 2 ? p.numel() : 0;
  }
  // Bytes sent in one Muon step, summed over the ranks (the formula is per rank on average).
  at::Tensor sent = at::full({1}, static_cast<double>(mode.total_bytes_in()), at::kDouble);
  dtensor::all_reduce_(sent, dtensor::ReduceOp::Sum, dtensor::world_group());
  if (dtensor::get_rank() == 0) {
    const auto& e = muon.last_exchanges();
    std::printf("RESULT {\"ranks\": %d, \"dim\": %lld, \"layers\": %lld, \"matrix_elements\": "
                "%lld, \"adamw_s\": %s, \"muon_s\": %s, \"all_to_alls\": %lld, "
                "\"bytes_in_mean\": %lld, \"bytes_to_owners\": %lld, \"owned\": %lld}\n",
                world, static_cast<long long>(a.dim), static_cast<long long>(a.layers),
                static_cast<long long>(elements), bench::json_list(adamw_s).c_str(),
                bench::json_list(muon_s).c_str(),
                static_cast<long long>(mode.count(dtensor::CollectiveKind::AllToAll)),
                static_cast<long long>(sent.item<double>() / world),
                static_cast<long long>(e.empty() ? 0 : e[0].bytes_to_owners),
                static_cast<long long>(e.empty() ? 0 : e[0].matrices[0]));
  }
  dtensor::destroy_process_group();
  return 0;
}
