// `train --simulate WORLD`: plans the Llama 3 recipe on WORLD ranks before running it
// (docs/simulation.md). For each mesh of --mesh (a comma-separated list of AxBxC; default
// tp 8, the rest dp_shard), it runs the unchanged recipe as a sample of the world's ranks
// (ranks_to_simulate: all up to 64, extremes and a random sample above), each a child process
// of this one under DTENSOR_SIMULATE=WORLD:RANK for two steps (the second, reported, has
// fully_shard's steady-state prefetching), reads their RankReports, checks the plan across
// them (check_plan), prints a table per mesh (memory by category, bytes per step by mesh
// dimension, FLOPs, the predicted step time and tokens/s per GPU of [Note: the time model])
// and writes OUT/simulation.json and its chart OUT/simulation.png (scripts/plot_simulation.py).
//
//   build/examples/train --simulate 1024 --mesh 8x16x8 --model llama3-8b --seq 8192 --batch 64
//
// Flags of its own: --simulate WORLD, --mesh LIST, --out DIR (train-out/simulation), --sample N
// (random ranks beyond the extremes, 8), --jobs N (children at once: the cores), and the time
// model's --tflops X (achieved, 400), --node N (GPUs per node, 8), --nvlink-gbps X (360),
// --network-gbps X (45), --p2p-gbps X (0: the links'), --cluster ROW (collectives by NCCL's
// algorithms on a row of dtensor/collective_cost.h's table). The others (--model, --seq, --batch,
// --ac, --precision, ...) go to every simulated rank.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include <dtensor/pipeline_schedule.h>
#include <dtensor/simulate.h>

#include "common.h"
#include "flags.h"
#include "plot_paths.h"

extern char** environ;

namespace dtensor::train {

using cli::FlagTable;

namespace {

struct SimFlags {
  int64_t world = 0;
  std::vector<std::vector<int64_t>> meshes;
  std::string out = "train-out/simulation";
  int64_t sample = 8;
  int64_t jobs = std::max<int64_t>(1, std::thread::hardware_concurrency());
  TimeModelOptions time;
  std::vector<std::string> passed; // to the simulated ranks
  // Read from the passed flags: the recipe's pipeline and context-parallel degrees, the
  // schedule and its microbatches (pipeline_microbatches' default: 2 x pp).
  int64_t pp = 1, cp = 1, microbatches = 0;
  std::string pp_schedule = "1F1B";
};

// The value after `name` in the passed flags ("" when absent).
std::string passed_value(const std::vector<std::string>& passed, const std::string& name) {
  for (size_t i = 0; i + 1 < passed.size(); ++i) {
    if (passed[i] == name) {
      return passed[i + 1];
    }
  }
  return "";
}

[[noreturn]] void sim_usage(const std::string& why) {
  std::fprintf(stderr, "train --simulate: %s (train --simulate 1 --help lists the flags)\n",
               why.c_str());
  std::exit(2);
}

std::vector<int64_t> mesh_of(const std::string& s) {
  std::vector<int64_t> m;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, 'x')) {
    m.push_back(std::stoll(part));
  }
  if (m.size() != 3) {
    sim_usage("a mesh is dp_replicate x dp_shard x tp, e.g. 8x16x8; got " + s);
  }
  return m;
}

SimFlags parse_sim(int argc, char** argv) {
  SimFlags f;
  std::string meshes;
  FlagTable t("train --simulate", "examples/train/simulate.cpp; the other flags go to every "
                                  "simulated rank: train --help");
  t.value("--simulate", "the world size", f.world)
      .value("--mesh",
             "comma-separated AxBxC (dp_replicate x dp_shard x tp) meshes; default tp "
             "8, the rest dp_shard",
             meshes)
      .value("--out", "output directory (train-out/simulation)", f.out)
      .value("--sample", "random ranks beyond the extremes (8)", f.sample)
      .value("--jobs", "children at once (the cores)",
             [&f](const std::string& v) { f.jobs = std::max<int64_t>(1, FlagTable::parse_int(v)); })
      .value("--tflops", "achieved TFLOP/s per GPU (400)",
             [&f](const std::string& v) { f.time.achieved_tflops(FlagTable::parse_double(v)); })
      .value("--node", "GPUs per node (8)",
             [&f](const std::string& v) { f.time.ranks_per_node(FlagTable::parse_int(v)); })
      .value("--nvlink-gbps", "intra-node GB/s (360)",
             [&f](const std::string& v) { f.time.intra_node_gbps(FlagTable::parse_double(v)); })
      .value("--network-gbps", "inter-node GB/s (45)",
             [&f](const std::string& v) { f.time.inter_node_gbps(FlagTable::parse_double(v)); })
      .value("--p2p-gbps", "a send's GB/s to one peer where below the links' (0: theirs)",
             [&f](const std::string& v) { f.time.p2p_gbps(FlagTable::parse_double(v)); })
      .value("--cluster", "collectives by NCCL's algorithms on a row: h100, h200, b200, gb200, cpu",
             [&f](const std::string& v) {
               f.time.cluster(cluster_spec(v));
               f.time.ranks_per_node(f.time.cluster()->gpus_per_node());
             });
  t.parse(argc, argv, &f.passed);
  if (f.world < 1) {
    sim_usage("--simulate takes the world size, at least 1");
  }
  for (const auto& a : f.passed) { // the driver reads each rank's report where it asked for it
    for (const std::string name : {"--report", "--metrics"}) {
      if (a == name || a.rfind(name + "=", 0) == 0) {
        sim_usage(name + " is the planner's own: each simulated rank's report and metrics go "
                         "under --out DIR/<mesh>/ (train-out/simulation)");
      }
    }
  }
  for (const char* name : {"--pp", "--cp"}) {
    const std::string v = passed_value(f.passed, name);
    (std::string(name) == "--pp" ? f.pp : f.cp) = v.empty() ? 1 : FlagTable::parse_int(v);
  }
  const std::string micro = passed_value(f.passed, "--microbatches");
  f.microbatches = micro.empty() ? 0 : FlagTable::parse_int(micro);
  if (!passed_value(f.passed, "--pp-schedule").empty()) {
    f.pp_schedule = passed_value(f.passed, "--pp-schedule");
  }
  if (f.pp < 1 || f.cp < 1 || f.world % (f.pp * f.cp) != 0) {
    sim_usage("--pp " + std::to_string(f.pp) + " x --cp " + std::to_string(f.cp) +
              " does not divide the " + std::to_string(f.world) + " ranks");
  }
  const int64_t rest = f.world / (f.pp * f.cp); // dp_replicate x dp_shard x tp
  if (meshes.empty()) { // torchtitan's usual layout: tp within a node of 8, dp_shard across
    const int64_t tp = std::gcd(rest, int64_t{8});
    meshes = "1x" + std::to_string(rest / tp) + "x" + std::to_string(tp);
  }
  std::stringstream in(meshes);
  std::string one;
  while (std::getline(in, one, ',')) {
    f.meshes.push_back(mesh_of(one));
    const auto& m = f.meshes.back();
    if (m[0] * m[1] * m[2] * f.pp * f.cp != f.world) {
      sim_usage("--mesh " + one + " with --pp " + std::to_string(f.pp) + " and --cp " +
                std::to_string(f.cp) + " does not cover the " + std::to_string(f.world) + " ranks");
    }
  }
  return f;
}

std::string mesh_name(const std::vector<int64_t>& m) {
  return std::to_string(m[0]) + "x" + std::to_string(m[1]) + "x" + std::to_string(m[2]);
}

// Where this run's simulated pipeline ranks leave their shapes ([Note: shapes across simulated
// stages] in lib/mesh/backend_fake.cpp): a directory named for this process, under the mesh's.
std::string p2p_dir(const std::string& dir) {
  return dir + "/.p2p-" + std::to_string(::getpid());
}

// Runs this program as simulated rank `rank`; returns its pid.
pid_t spawn_rank(const std::string& self, const SimFlags& f, const std::vector<int64_t>& mesh,
                 int rank, const std::string& dir) {
  std::vector<std::string> args{self,      "--mesh",    mesh_name(mesh),
                                "--steps", "2",         "--report",
                                dir,       "--metrics", dir + "/metrics.jsonl"};
  args.insert(args.end(), f.passed.begin(), f.passed.end());
  std::vector<std::string> env{
      "DTENSOR_SIMULATE=" + std::to_string(f.world) + ":" + std::to_string(rank),
      "DTENSOR_SIMULATE_NODE=" + std::to_string(f.time.ranks_per_node()), "OMP_NUM_THREADS=1"};
  if (f.pp > 1) { // [Note: shapes across simulated stages] (lib/mesh/backend_fake.cpp)
    env.push_back("DTENSOR_SIMULATE_P2P=" + p2p_dir(dir));
  }
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var(*e);
    if (var.rfind("DTENSOR_SIMULATE", 0) != 0 && var.rfind("OMP_NUM_THREADS=", 0) != 0) {
      env.emplace_back(*e);
    }
  }
  std::vector<char*> argp, envp;
  for (auto& a : args) {
    argp.push_back(a.data());
  }
  argp.push_back(nullptr);
  for (auto& e : env) {
    envp.push_back(e.data());
  }
  envp.push_back(nullptr);
  posix_spawn_file_actions_t io;
  posix_spawn_file_actions_init(&io);
  const std::string log = dir + "/rank" + std::to_string(rank) + ".log";
  posix_spawn_file_actions_addopen(&io, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&io, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = 0;
  const int err = posix_spawn(&pid, self.c_str(), &io, nullptr, argp.data(), envp.data());
  posix_spawn_file_actions_destroy(&io);
  if (err != 0) {
    sim_usage("could not start " + self + ": " + std::strerror(err));
  }
  return pid;
}

// Every rank of `ranks` simulated, `jobs` at a time; their reports.
std::vector<RankReport> simulate_ranks(const std::string& self, const SimFlags& f,
                                       const std::vector<int64_t>& mesh,
                                       const std::vector<int>& ranks, const std::string& dir) {
  std::filesystem::create_directories(dir);
  std::map<pid_t, int> running;
  size_t next = 0;
  while (next < ranks.size() || !running.empty()) {
    // Under --pp every rank at once: a later stage's rank waits for an earlier one's shapes.
    while (next < ranks.size() && (f.pp > 1 || static_cast<int64_t>(running.size()) < f.jobs)) {
      running[spawn_rank(self, f, mesh, ranks[next], dir)] = ranks[next];
      ++next;
    }
    int status = 0;
    const pid_t done = wait(&status);
    const int rank = running.at(done);
    running.erase(done);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      for (const auto& [pid, r] : running) {
        kill(pid, SIGKILL);
      }
      sim_usage("simulated rank " + std::to_string(rank) + " of " + mesh_name(mesh) +
                " failed; its output: " + dir + "/rank" + std::to_string(rank) + ".log");
    }
  }
  std::vector<RankReport> reports;
  for (int r : ranks) {
    std::ifstream in(dir + "/rank" + std::to_string(r) + ".json");
    std::stringstream text;
    text << in.rdbuf();
    reports.push_back(RankReport::from_json(text.str()));
  }
  return reports;
}

double gib(int64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
}

// The largest value over the simulated ranks of each figure, and bytes per step by group.
// The slowest simulated rank's predicted step ([Note: the time model]).
nlohmann::json predicted_time(const std::vector<RankReport>& reports, const TimeModelOptions& o) {
  StepTime slowest;
  for (const auto& r : reports) {
    StepTime t = predict_step_time(r, o);
    if (t.total_s >= slowest.total_s) {
      slowest = std::move(t);
    }
  }
  nlohmann::json phases = nlohmann::json::array();
  for (const auto& p : slowest.phases) {
    phases.push_back({{"name", p.name},
                      {"compute_s", p.compute_s},
                      {"sync_comm_s", p.sync_comm_s},
                      {"async_comm_s", p.async_comm_s},
                      {"total_s", p.total_s}});
  }
  return {{"step_s", slowest.total_s},
          {"tokens_per_s_per_gpu", slowest.tokens_per_second_per_rank},
          {"phases", phases}};
}

nlohmann::json summarize(const std::vector<int64_t>& mesh, const std::vector<RankReport>& reports,
                         const std::vector<PlanMismatch>& mismatches, const TimeModelOptions& o) {
  nlohmann::json memory = {{"parameters", 0}, {"gradients", 0}, {"optimizer", 0},
                           {"fsdp_peak", 0},  {"step_peak", 0}, {"activations", 0}};
  std::map<std::string, int64_t> bytes;
  int64_t flops = 0;
  auto raise = [&](const char* key, int64_t v) {
    memory[key] = std::max(memory[key].get<int64_t>(), v);
  };
  for (const auto& r : reports) {
    raise("parameters", r.parameter_bytes);
    raise("gradients", r.gradient_bytes);
    raise("optimizer", r.optimizer_bytes);
    raise("fsdp_peak", r.fsdp_peak_bytes);
    raise("step_peak", r.peak_bytes);
    raise("activations", r.peak_bytes - r.start_bytes - r.fsdp_peak_bytes);
    std::map<std::string, int64_t> mine;
    for (const auto& c : r.collectives()) {
      mine[c.group] += c.bytes_in;
    }
    for (const auto& [g, b] : mine) {
      bytes[g] = std::max(bytes[g], b);
    }
    flops = std::max(flops, r.flops());
  }
  nlohmann::json problems = nlohmann::json::array();
  for (const auto& m : mismatches) {
    problems.push_back(m.message);
  }
  std::vector<int> ranks;
  for (const auto& r : reports) {
    ranks.push_back(r.rank);
  }
  return {{"mesh", mesh_name(mesh)},    {"ranks", ranks}, {"memory", memory},
          {"bytes_by_dim", bytes},      {"flops", flops}, {"time", predicted_time(reports, o)},
          {"plan_mismatches", problems}};
}

void print_summary(const nlohmann::json& s, int64_t world) {
  const auto& m = s["memory"];
  std::printf("mesh %s (dp_replicate x dp_shard x tp) on %lld ranks, %zu simulated: plan %s\n",
              s["mesh"].get<std::string>().c_str(), static_cast<long long>(world),
              s["ranks"].size(), s["plan_mismatches"].empty() ? "consistent" : "INCONSISTENT");
  for (const auto& p : s["plan_mismatches"]) {
    std::printf("  %s\n", p.get<std::string>().c_str());
  }
  std::printf("  per rank (GiB): parameters %.3f  gradients %.3f  optimizer %.3f  fsdp peak %.3f"
              "  activations %.3f  step peak %.3f\n",
              gib(m["parameters"]), gib(m["gradients"]), gib(m["optimizer"]), gib(m["fsdp_peak"]),
              gib(m["activations"]), gib(m["step_peak"]));
  std::printf("  bytes sent per step (GiB):");
  for (const auto& [g, b] : s["bytes_by_dim"].items()) {
    std::printf("  %s %.3f", g.c_str(), gib(b.get<int64_t>()));
  }
  std::printf("\n  compute per step: %.1f TFLOP\n", s["flops"].get<double>() / 1e12);
  const auto& t = s["time"];
  std::printf("  predicted step %.3f s (", t["step_s"].get<double>());
  for (const auto& p : t["phases"]) {
    std::printf(" %s %.3f: compute %.3f + waits %.3f, beside %.3f;",
                p["name"].get<std::string>().c_str(), p["total_s"].get<double>(),
                p["compute_s"].get<double>(), p["sync_comm_s"].get<double>(),
                p["async_comm_s"].get<double>());
  }
  std::printf(" ), %.0f tokens/s per GPU\n", t["tokens_per_s_per_gpu"].get<double>());
  if (s.contains("pipeline")) {
    const auto& p = s["pipeline"];
    std::printf("  pipeline: %s, %d microbatches, %d stages: bubble %.1f%% (the step above is the "
                "rank's compute and communication, %.3f s, over 1 - bubble)\n",
                p["schedule"].get<std::string>().c_str(), p["microbatches"].get<int>(),
                p["stages"].get<int>(), 100.0 * p["bubble_fraction"].get<double>(),
                t["compute_only_step_s"].get<double>());
  }
}

// OUT/simulation.png, by scripts/plot_simulation.py with the Python the build was configured
// with (matplotlib is in the project's venv); a line saying how otherwise.
void draw_chart(const std::string& out) {
  const std::string cmd = std::string("'") + plot_python() + "' '" + plot_script() + "' '" + out +
                          "/simulation.png' '" + out + "/simulation.json' > /dev/null";
  if (std::system(cmd.c_str()) == 0) {
    std::printf("chart: %s/simulation.png\n", out.c_str());
    return;
  }
  std::printf("chart: python scripts/plot_simulation.py %s/simulation.png %s/simulation.json "
              "(needs matplotlib)\n",
              out.c_str(), out.c_str());
}

// The recipe's whole mesh: (pp, dp_replicate, dp_shard, tp) or (dp_replicate, dp_shard, cp, tp).
std::vector<int64_t> world_shape(const SimFlags& f, const std::vector<int64_t>& mesh) {
  if (f.pp > 1) {
    return {f.pp, mesh[0], mesh[1], mesh[2]};
  }
  if (f.cp > 1) {
    return {mesh[0], mesh[1], f.cp, mesh[2]};
  }
  return mesh;
}

// The ranks to simulate: ranks_to_simulate's of the whole mesh and, under --pp, the first rank
// of every stage (each later stage learns its input's shape from one of them).
std::vector<int> plan_ranks(const SimFlags& f, const std::vector<int64_t>& mesh) {
  std::vector<int> ranks =
      ranks_to_simulate(world_shape(f, mesh), f.sample, /*seed=*/static_cast<uint64_t>(f.world));
  const int64_t per_stage = f.world / f.pp;
  for (int64_t s = 0; s < f.pp; ++s) {
    ranks.push_back(static_cast<int>(s * per_stage));
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
}

// [Note: the pipeline's bubble in the plan] A simulated pipeline rank reports the compute of
// its own stages' forwards and backwards, every microbatch, not the time it waits for the
// other stages. The schedule simulator times the recipe's schedule (the same
// generate_schedule) with each forward one unit and each backward two: the step is the
// rank's predicted time scaled by makespan / its busy time, i.e. divided by (1 - bubble).
void add_pipeline_bubble(const SimFlags& f, nlohmann::json& s) {
  const ScheduleKind kind = schedule_kind(f.pp_schedule);
  const int per_rank = is_single_stage(kind) ? 1 : 2;
  const int micro = static_cast<int>(f.microbatches > 0 ? f.microbatches : 2 * f.pp);
  const PipelineOrder order = generate_schedule(kind, static_cast<int>(f.pp), micro, per_rank);
  const ScheduleTimeline t =
      simulate_schedule(order, static_cast<int>(f.pp) * per_rank, ScheduleCosts());
  const double busy = *std::max_element(t.busy.begin(), t.busy.end());
  const double scale = t.makespan / busy;
  auto& time = s["time"];
  time["compute_only_step_s"] = time["step_s"];
  time["step_s"] = time["step_s"].get<double>() * scale;
  time["tokens_per_s_per_gpu"] = time["tokens_per_s_per_gpu"].get<double>() / scale;
  s["pipeline"] = {{"schedule", f.pp_schedule},    {"microbatches", micro},
                   {"stages", f.pp * per_rank},    {"bubble_fraction", t.bubble_fraction},
                   {"makespan_units", t.makespan}, {"step_scale", scale}};
}

} // namespace

int run_simulate(int argc, char** argv) {
  const SimFlags f = parse_sim(argc, argv);
  const std::string self = std::filesystem::canonical("/proc/self/exe").string();
  nlohmann::json all = {{"world", f.world},
                        {"time_model",
                         {{"achieved_tflops", f.time.achieved_tflops()},
                          {"ranks_per_node", f.time.ranks_per_node()},
                          {"intra_node_gbps", f.time.intra_node_gbps()},
                          {"inter_node_gbps", f.time.inter_node_gbps()},
                          {"intra_node_latency_us", f.time.intra_node_latency_us()},
                          {"inter_node_latency_us", f.time.inter_node_latency_us()},
                          {"p2p_gbps", f.time.p2p_gbps()},
                          {"cluster", f.time.cluster() ? f.time.cluster()->name() : "ring"}}},
                        {"meshes", nlohmann::json::array()}};
  bool consistent = true;
  for (const auto& mesh : f.meshes) {
    const auto ranks = plan_ranks(f, mesh);
    const std::string dir = f.out + "/" + mesh_name(mesh);
    if (f.pp > 1) { // a directory of this run's own, removed after it
      std::filesystem::create_directories(dir);
      if (!std::filesystem::create_directory(p2p_dir(dir))) {
        sim_usage(p2p_dir(dir) + " exists already; remove it (it is not this run's)");
      }
    }
    const auto reports = simulate_ranks(self, f, mesh, ranks, dir);
    if (f.pp > 1) {
      std::filesystem::remove_all(p2p_dir(dir)); // created above, written by this run's ranks
    }
    const auto mismatches = check_plan(reports);
    consistent = consistent && mismatches.empty();
    all["meshes"].push_back(summarize(mesh, reports, mismatches, f.time));
    if (f.pp > 1) {
      add_pipeline_bubble(f, all["meshes"].back());
    }
    print_summary(all["meshes"].back(), f.world);
  }
  write_output(f.out + "/simulation.json", all.dump(2) + "\n");
  std::printf("reports in %s/<mesh>/rank<R>.json; summary in %s/simulation.json\n", f.out.c_str(),
              f.out.c_str());
  draw_chart(f.out);
  return consistent ? 0 : 1;
}

} // namespace dtensor::train
