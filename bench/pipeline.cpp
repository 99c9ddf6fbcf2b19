// One pipeline step, timed: the dtensor side of bench/pipeline.py, which runs PyTorch's
// torch.distributed.pipelining on the same model, schedule and microbatches alternately with
// it. Run under torchrun; every rank is a pipeline rank.
//   model: `layers` blocks Linear(d, 4d)-GELU-Linear(4d, d), split evenly into stages
//          (one per rank, or two for the multi-stage schedules); input [batch, 64, d], loss
//          sum((out - target)^2) / batch; gradients zeroed before each step, no optimizer.
// Flags: --schedule NAME (PyTorch's class names without "Schedule": GPipe, 1F1B,
//        Interleaved1F1B, ZBVZeroBubble, ...), --microbatches M, --dim D, --layers L,
//        --batch B, --steps N, --warmup N.
// Rank 0 prints one line, "RESULT <json>": the step times (ms), the growth of the resident
// set from the end of the warm-up steps to its peak over the timed steps (MB, the largest
// over ranks: what a step holds at its peak), the measured bubble (1 - busy time of all
// ranks / (ranks x step time), from PipelineOptions::record_timeline) and the bubble the
// timed simulation predicts from the measured mean cost of each action type, without and
// with the measured point-to-point latency of one activation (half a round trip between
// ranks 0 and 1). Under LD_PRELOAD of bench/live_bytes.cpp: also the peak of live tensor
// bytes over the timed steps (MB, the largest over ranks).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "bench_util.h"
#include "flags.h"
#include <dtensor/all.h>

namespace {

using Clock = std::chrono::steady_clock;
using bench::json_list;
using bench::live_bytes_fn;
using bench::median;

struct Flags {
  std::string schedule = "1F1B";
  int microbatches = 8;
  int64_t dim = 256;
  int layers = 8;
  int64_t batch = 32;
  int64_t steps = 10;
  int64_t warmup = 3;
};

Flags parse(int argc, char** argv) {
  using dtensor::cli::FlagTable;
  Flags f;
  // The schedule's counts are int (generate_schedule, PipelineSchedule).
  auto int_value = [](int& target) {
    return [&target](const std::string& v) {
      const int64_t n = FlagTable::parse_int(v);
      if (!std::in_range<int>(n)) {
        throw std::out_of_range("out of range");
      }
      target = static_cast<int>(n);
    };
  };
  FlagTable("bench_pipeline", "bench/pipeline.cpp")
      .value("--schedule", "PyTorch's schedule class name without \"Schedule\" (1F1B)",
             [&f](const std::string& v) {
               dtensor::schedule_kind(v); // throws on an unknown name
               f.schedule = v;
             })
      .value("--microbatches", "microbatches per step (8)", int_value(f.microbatches))
      .value("--dim", "model width (256)", f.dim)
      .value("--layers", "blocks, split evenly over the stages (8)", int_value(f.layers))
      .value("--batch", "samples per step, split into the microbatches (32)", f.batch)
      .value("--steps", "timed steps (10)", f.steps)
      .value("--warmup", "untimed steps before them (3)", f.warmup)
      .parse(argc, argv);
  return f;
}

// Linear(d, 4d)-GELU-Linear(4d, d).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : up(register_module("up", torch::nn::Linear(d, 4 * d))),
        down(register_module("down", torch::nn::Linear(4 * d, d))) {}
  at::Tensor forward(const at::Tensor& x) { return down->forward(gelu->forward(up->forward(x))); }
  torch::nn::Linear up, down;
  torch::nn::GELU gelu;
};
TORCH_MODULE(Block);

// Resident set size now, MB (/proc/self/statm's second field, in pages).
double rss_mb() {
  std::ifstream statm("/proc/self/statm");
  long size = 0, resident = 0;
  statm >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / 1e6;
}

// Starts a new peak of the resident set (Linux: "5" to /proc/self/clear_refs resets VmHWM);
// returns the resident set now, MB. The library's loading peaks far above a step's needs,
// so getrusage's lifetime peak would measure start-up, not the steps.
double reset_peak_rss_mb() {
  std::ofstream("/proc/self/clear_refs") << "5";
  return rss_mb();
}

// The peak resident set size since reset_peak_rss_mb(), MB (/proc/self/status's VmHWM).
double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  std::string key;
  double kb = 0;
  while (status >> key) {
    if (key == "VmHWM:") {
      status >> kb;
      break;
    }
  }
  return kb / 1e3;
}

// Half the median round trip of `shape` floats between ranks 0 and 1 (the others idle),
// seconds: the simulation's p2p latency for one activation.
double p2p_latency(const std::vector<int64_t>& shape) {
  const int rank = dtensor::get_rank();
  at::Tensor buf = at::zeros(shape);
  std::vector<double> trips;
  for (int i = 0; i < 21; ++i) {
    dtensor::barrier(dtensor::world_group());
    const auto t0 = Clock::now();
    if (rank == 0) {
      dtensor::send(buf, 1, dtensor::world_group()).wait();
      dtensor::recv(buf, 1, dtensor::world_group()).wait();
    } else if (rank == 1) {
      dtensor::recv(buf, 0, dtensor::world_group()).wait();
      dtensor::send(buf, 0, dtensor::world_group()).wait();
    }
    trips.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(trips.begin(), trips.end());
  at::Tensor half = at::tensor({rank == 0 ? trips[trips.size() / 2] / 2 : 0.0}, at::kDouble);
  dtensor::all_reduce_(half, dtensor::ReduceOp::Max, dtensor::world_group());
  return half.item<double>();
}

// The timed figures' index of a compute action type: F, I, W, B.
int type_index(dtensor::ActionType t) {
  switch (t) {
  case dtensor::ActionType::Forward:
    return 0;
  case dtensor::ActionType::BackwardInput:
    return 1;
  case dtensor::ActionType::BackwardWeight:
    return 2;
  default:
    return 3;
  }
}

} // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  at::set_num_threads(1);
  dtensor::init_process_group();
  const int world = dtensor::get_world_size();
  const int rank = dtensor::get_rank();
  auto pp = dtensor::init_device_mesh(c10::kCPU, {world}, {"pp"}).get_group();
  const auto kind = dtensor::schedule_kind(f.schedule);
  const int per_rank = dtensor::is_single_stage(kind) ? 1 : 2;
  const int num_stages = world * per_rank;
  const int per_stage = f.layers / num_stages;
  const auto order = dtensor::generate_schedule(kind, world, f.microbatches, per_rank);
  const auto placement = dtensor::stage_to_rank(kind, world, num_stages);
  torch::manual_seed(0);
  std::vector<Block> blocks;
  for (int i = 0; i < f.layers; ++i) {
    blocks.emplace_back(f.dim);
  }
  std::vector<dtensor::PipelineStage> stages;
  for (int s = 0; s < num_stages; ++s) {
    if (placement[static_cast<size_t>(s)] != rank) {
      continue;
    }
    auto holder = std::make_shared<torch::nn::Module>();
    std::vector<Block> mine(blocks.begin() + s * per_stage, blocks.begin() + (s + 1) * per_stage);
    for (size_t i = 0; i < mine.size(); ++i) {
      holder->register_module(std::to_string(i), mine[i].ptr());
    }
    stages.emplace_back(s, holder, [mine](at::Tensor x) mutable {
      for (auto& b : mine) {
        x = b->forward(x);
      }
      return x;
    });
  }
  const double batch = static_cast<double>(f.batch);
  dtensor::PipelineSchedule schedule(
      stages, pp, order, f.microbatches,
      [batch](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).sum() / batch; },
      dtensor::PipelineOptions().record_timeline(true).scale_grads(false));
  at::manual_seed(1);
  const at::Tensor input = at::randn({f.batch, 64, f.dim});
  const at::Tensor target = at::randn({f.batch, 64, f.dim});
  auto step = [&] {
    for (auto& st : stages) {
      for (auto& p : st.module->parameters()) {
        p.mutable_grad() = at::Tensor();
      }
    }
    schedule.step(input, target);
  };
  for (int i = 0; i < f.warmup; ++i) {
    step();
  }
  const double latency = p2p_latency({f.batch / f.microbatches, 64, f.dim});
  auto* live_peak = live_bytes_fn<int64_t()>("live_bytes_peak");
  if (auto* reset = live_bytes_fn<void()>("live_bytes_reset_peak")) {
    reset();
  }
  auto* live_now = live_bytes_fn<int64_t()>("live_bytes_now");
  const double live_before = live_now != nullptr ? static_cast<double>(live_now()) / 1e6 : -1.0;
  const double rss_before = reset_peak_rss_mb(); // after the warm-up's one-time costs
  std::vector<double> ms;
  // Seconds summed over the timed steps, per (stage, F / I / W / B, microbatch): each
  // action runs on one rank, so a sum over ranks assembles the whole schedule's.
  at::Tensor cost = at::zeros({num_stages, 4, f.microbatches}, at::kDouble);
  // A replay: each action costs what it measured (the per-action table `t`), the
  // ranks' order and dependencies the simulator's.
  auto replay_of = [&](const at::Tensor& t) {
    return dtensor::ScheduleCosts().p2p_latency(latency).action_cost(
        [t](const dtensor::PipelineAction& a) {
          return a.type == dtensor::ActionType::OverlapFB
                     ? -1.0
                     : t[a.stage][type_index(a.type)][*a.microbatch].item<double>();
        });
  };
  std::vector<double> busy_fraction, replay_bubbles;
  for (int i = 0; i < f.steps; ++i) {
    dtensor::barrier(dtensor::world_group());
    const auto t0 = Clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    double busy = 0;
    at::Tensor step_cost = at::zeros_like(cost);
    for (const auto& a : schedule.last_step_timeline()) {
      busy += a.end - a.start;
      step_cost[a.action.stage][type_index(a.action.type)][*a.action.microbatch] += a.end - a.start;
    }
    dtensor::all_reduce_(step_cost, dtensor::ReduceOp::Sum, dtensor::world_group());
    cost += step_cost;
    replay_bubbles.push_back(
        dtensor::simulate_schedule(order, num_stages, replay_of(step_cost)).bubble_fraction);
    // The measured bubble: every rank's busy time against the slowest rank's step.
    at::Tensor sums = at::tensor({busy, schedule.last_step_seconds()}, at::kDouble);
    at::Tensor wall = sums.narrow(0, 1, 1).clone();
    dtensor::all_reduce_(sums, dtensor::ReduceOp::Sum, dtensor::world_group());
    dtensor::all_reduce_(wall, dtensor::ReduceOp::Max, dtensor::world_group());
    busy_fraction.push_back(sums[0].item<double>() / (world * wall.item<double>()));
  }
  // The simulation's costs, three calibrations of the same measured actions: each action
  // type's mean over all stages and microbatches; each (stage, type)'s mean (a stage's own
  // cost: the last one's forward includes the loss); and each action's own mean over the
  // steps (a replay: what is left between it and the measured bubble is time outside the
  // compute actions, and ranks sharing cores).
  cost.div_(f.steps);
  auto type_mean = [&](int t) {
    at::Tensor c = cost.select(1, t);
    const double n = c.gt(0).sum().item<double>();
    return n > 0 ? c.sum().item<double>() / n : 0.0;
  };
  const double fwd = type_mean(0), in = type_mean(1), wt = type_mean(2), full = type_mean(3);
  const auto by_type = dtensor::ScheduleCosts()
                           .forward(fwd)
                           .full_backward(full > 0 ? full : in + wt)
                           .backward_input(in > 0 ? in : full / 2)
                           .backward_weight(wt > 0 ? wt : full / 2)
                           .p2p_latency(latency);
  const at::Tensor stage_mean = cost.sum(2) / cost.gt(0).sum(2).clamp_min(1);
  auto by_stage =
      dtensor::ScheduleCosts(by_type).action_cost([&](const dtensor::PipelineAction& a) {
        return a.type == dtensor::ActionType::OverlapFB
                   ? -1.0
                   : stage_mean[a.stage][type_index(a.type)].item<double>();
      });
  const auto predicted =
      dtensor::simulate_schedule(order, num_stages, dtensor::ScheduleCosts(by_type).p2p_latency(0));
  const auto with_latency = dtensor::simulate_schedule(order, num_stages, by_type);
  const auto staged = dtensor::simulate_schedule(order, num_stages, by_stage);
  const auto replayed = dtensor::simulate_schedule(order, num_stages, replay_of(cost));
  const double step_s = median(ms) / 1e3;
  at::Tensor live = at::tensor(
      {live_peak != nullptr ? static_cast<double>(live_peak()) / 1e6 : -1.0, live_before},
      at::kDouble);
  if (std::getenv("BENCH_PIPELINE_TIMELINES") != nullptr) { // the last step, measured and replayed
    for (const auto& a : schedule.last_step_timeline()) {
      std::fprintf(stderr, "measured %d %s %.2f %.2f\n", rank, a.action.str().c_str(),
                   a.start * 1e3, a.end * 1e3);
    }
    if (rank == 0) {
      for (const auto& a : replayed.actions) {
        std::fprintf(stderr, "replayed %d %s %.2f %.2f\n", a.rank, a.action.str().c_str(),
                     a.start * 1e3, a.end * 1e3);
      }
    }
  }
  if (std::getenv("BENCH_PIPELINE_VERBOSE") != nullptr) { // each rank's own figures
    std::fprintf(stderr, "rank %d: live %.2f MB before the timed steps, peak %.2f MB\n", rank,
                 live[1].item<double>(), live[0].item<double>());
  }
  dtensor::all_reduce_(live, dtensor::ReduceOp::Max, dtensor::world_group());
  at::Tensor growth = at::tensor({peak_rss_mb() - rss_before}, at::kDouble);
  dtensor::all_reduce_(growth, dtensor::ReduceOp::Max, dtensor::world_group());
  std::vector<double> bubbles;
  for (double b : busy_fraction) {
    bubbles.push_back(1.0 - b);
  }
  if (rank == 0) {
    std::printf("RESULT {\"step_ms\": %s, \"rss_growth_mb\": %f, \"bubble\": %s, "
                "\"simulated_bubble\": %f, \"simulated_bubble_p2p\": %f, \"p2p_ms\": %f, "
                "\"simulated_bubble_stage\": %f, \"simulated_bubble_replay\": %f, "
                "\"replay_bubbles\": %s, \"staged_makespan_ms\": %f, "
                "\"replay_makespan_fraction\": %f, "
                "\"live_peak_mb\": %f, \"live_before_mb\": %f, "
                "\"costs_ms\": [%f, %f, %f, %f]}\n",
                json_list(ms).c_str(), growth.item<double>(), json_list(bubbles).c_str(),
                predicted.bubble_fraction, with_latency.bubble_fraction, latency * 1e3,
                staged.bubble_fraction, replayed.bubble_fraction, json_list(replay_bubbles).c_str(),
                staged.makespan * 1e3, replayed.makespan / step_s, live[0].item<double>(),
                live[1].item<double>(), fwd * 1e3, full * 1e3, in * 1e3, wt * 1e3);
    std::fflush(stdout);
  }
  return 0;
}
