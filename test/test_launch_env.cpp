// The launch environment ([Note: the launch environment] in lib/mesh/launch_env.h): rank,
// world, local rank and local world from torchrun's, SLURM's and Open MPI's variables, the
// backend BackendType::Auto picks and each rank's device with 0, 1 and 8 visible CUDA devices
// (injected: these run on the CPU), and the warning. Pure: one process.
#include <map>

#include "mesh/launch_env.h"
#include "support/prelude.h"

namespace {

using dtensor::BackendType;
using dtensor::ProcessGroupOptions;
using dtensor::detail::Launch;
using Env = std::map<std::string, std::string>;

Launch resolve(const Env& env, int devices, bool nccl,
               const ProcessGroupOptions& options = ProcessGroupOptions()) {
  return dtensor::detail::resolve_launch(
      options,
      [env](const std::string& name) -> std::optional<std::string> {
        auto it = env.find(name);
        return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
      },
      devices, nccl);
}

// Rank 9 of two hosts with 8 ranks each (host 1, local rank 1), as each launcher says it.
const Env kTorchrun{
    {"RANK", "9"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "8"}};
const Env kSlurm{{"SLURM_STEP_ID", "0"},
                 {"SLURM_PROCID", "9"},
                 {"SLURM_NTASKS", "16"},
                 {"SLURM_STEP_NUM_TASKS", "16"},
                 {"SLURM_LOCALID", "1"},
                 {"SLURM_NODEID", "1"},
                 {"SLURM_NTASKS_PER_NODE", "8"},
                 {"SLURM_TASKS_PER_NODE", "8(x2)"},
                 {"SLURM_STEP_TASKS_PER_NODE", "8(x2)"}};
const Env kOpenMpi{{"OMPI_COMM_WORLD_RANK", "9"},
                   {"OMPI_COMM_WORLD_SIZE", "16"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}};

Env merged(Env a, const Env& b) {
  a.insert(b.begin(), b.end());
  return a;
}

} // namespace

// Guards the backend choice and device binding on every launcher: NCCL whenever the build has
// it and a device is visible, whatever the local world; device LOCAL_RANK % devices; the
// warning exactly when a GPU job runs on Gloo or ranks share devices.
TEST_CASE("launch: each launcher, 0/1/8 devices, with and without NCCL", "[launch_env][world1]") {
  // SLURM's variables alone, then with SLURM_NTASKS_PER_NODE only (no step list), then Open MPI.
  Env slurm_ntasks_per_node = kSlurm;
  slurm_ntasks_per_node.erase("SLURM_STEP_TASKS_PER_NODE");
  slurm_ntasks_per_node.erase("SLURM_TASKS_PER_NODE");
  const std::vector<std::pair<Env, std::vector<std::string>>> launchers{
      {kTorchrun, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}},
      {kSlurm,
       {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"}},
      {slurm_ntasks_per_node,
       {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"}},
      {kOpenMpi,
       {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE"}},
  };
  for (const auto& [env, sources] : launchers) {
    for (int devices : {0, 1, 8}) {
      for (bool nccl : {false, true}) {
        INFO(sources[0] << ", " << devices << " device(s), nccl " << nccl);
        const Launch l = resolve(env, devices, nccl);
        REQUIRE(l.rank.value == 9);
        REQUIRE(l.world_size.value == 16);
        REQUIRE(l.local_rank.value == 1);
        REQUIRE(l.local_world.value == 8);
        REQUIRE(std::vector<std::string>{l.rank.source, l.world_size.source, l.local_rank.source,
                                         l.local_world.source} == sources);
        const bool uses_nccl = nccl && devices > 0;
        REQUIRE(l.backend == (uses_nccl ? BackendType::Nccl : BackendType::Gloo));
        REQUIRE(l.device == (devices == 8 ? 1 : 0));
        if (devices > 0 && !nccl) {
          REQUIRE_THAT(l.warning, contains(std::to_string(devices) +
                                           " CUDA device(s) are visible but dtensor was built "
                                           "without NCCL"));
          REQUIRE_THAT(l.warning, contains("backend auto chose gloo"));
        } else if (devices == 1 && nccl) {
          REQUIRE_THAT(l.warning, contains("local world size 8 (" + sources[3]));
          REQUIRE_THAT(l.warning, contains("is larger than the 1 visible CUDA device(s)"));
          REQUIRE_THAT(l.warning, contains("NCCL refuses two ranks of one communicator"));
        } else {
          REQUIRE(l.warning.empty());
        }
      }
    }
  }
}

// Guards the multi-node SLURM launch without LOCAL_WORLD_SIZE (RANK, WORLD_SIZE, LOCAL_RANK
// mapped by hand, as the README once did): the local world is SLURM's tasks on this node, not
// the world, so two 8-GPU hosts run on NCCL and rank 9 binds cuda:1.
TEST_CASE("launch: SLURM 2x8 without LOCAL_WORLD_SIZE picks NCCL", "[launch_env][world1]") {
  const Env env = merged({{"RANK", "9"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}}, kSlurm);
  const Launch l = resolve(env, 8, true);
  REQUIRE(l.backend == BackendType::Nccl);
  REQUIRE(l.local_world.value == 8);
  REQUIRE(l.local_world.source == "SLURM_STEP_TASKS_PER_NODE");
  REQUIRE(l.rank.source == "RANK");
  REQUIRE(l.device == 1);
  REQUIRE(l.warning.empty());
}

// Guards the warning when ranks would share devices: no local world given anywhere, so it is
// the world's 16 on 8 devices; the warning names where the value came from and what was set.
TEST_CASE("launch: ranks sharing devices are warned about", "[launch_env][world1]") {
  const Env env{{"RANK", "9"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "9"}};
  const Launch l = resolve(env, 8, true);
  REQUIRE(l.backend == BackendType::Nccl);
  REQUIRE(l.local_world.value == 16);
  REQUIRE(l.local_world.source == "default");
  REQUIRE(l.device == 1);
  REQUIRE_THAT(l.warning, contains("init_process_group (rank 9 of 16, local rank 9)"));
  REQUIRE_THAT(l.warning, contains("local world size 16 (the world size: none of "
                                   "LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE is set)"));
  REQUIRE_THAT(l.warning, contains("local ranks 0 and 8 both bind cuda:0"));
  REQUIRE_THAT(l.warning, contains("variables seen: RANK=9 WORLD_SIZE=16 LOCAL_RANK=9"));
  // Explicit NCCL on the same layout: the same warning.
  REQUIRE_THAT(resolve(env, 8, true, ProcessGroupOptions().backend(BackendType::Nccl)).warning,
               contains("share devices"));
}

// Guards SLURM's forms: the step's list before the job's SLURM_NTASKS_PER_NODE (a step of fewer
// tasks leaves the job's value in place), "N(xK)" lists indexed by SLURM_NODEID, and SLURM's
// variables read only inside an srun step.
TEST_CASE("launch: SLURM task lists and steps", "[launch_env][world1]") {
  const Env uneven{{"SLURM_STEP_ID", "3"},
                   {"SLURM_PROCID", "7"},
                   {"SLURM_NTASKS", "8"},
                   {"SLURM_LOCALID", "1"},
                   {"SLURM_NODEID", "2"},
                   {"SLURM_NTASKS_PER_NODE", "8"},
                   {"SLURM_STEP_TASKS_PER_NODE", "3(x2),2"}};
  const Launch l = resolve(uneven, 8, true);
  REQUIRE(l.local_world.value == 2);
  REQUIRE(l.local_world.detail == "SLURM_STEP_TASKS_PER_NODE='3(x2),2' at SLURM_NODEID=2");
  REQUIRE(l.world_size.source == "SLURM_NTASKS");
  REQUIRE(l.device == 1);

  Env no_node = uneven;
  no_node.erase("SLURM_NODEID");
  REQUIRE_THROWS_WITH(resolve(no_node, 8, true),
                      contains("SLURM_STEP_TASKS_PER_NODE='3(x2),2' gives different task counts "
                               "per node, but SLURM_NODEID"));
  Env far_node = uneven;
  far_node["SLURM_NODEID"] = "3";
  REQUIRE_THROWS_WITH(resolve(far_node, 8, true),
                      contains("SLURM_NODEID=3 is out of range for "
                               "SLURM_STEP_TASKS_PER_NODE='3(x2),2' (3 nodes)"));

  // A batch script or an salloc shell (no SLURM_STEP_ID) is one process whatever SLURM says.
  Env batch = kSlurm;
  batch.erase("SLURM_STEP_ID");
  const Launch alone = resolve(batch, 8, true);
  REQUIRE(alone.rank.value == 0);
  REQUIRE(alone.world_size.value == 1);
  REQUIRE(alone.local_world.value == 1);
  REQUIRE(alone.rank.source == "default");
  REQUIRE(alone.warning.empty());
}

// Guards precedence: explicit options over every variable, torchrun over SLURM over Open MPI,
// each quantity on its own; defaults for a program started alone.
TEST_CASE("launch: precedence and defaults", "[launch_env][world1]") {
  const Launch both = resolve(merged(kTorchrun, merged(kSlurm, kOpenMpi)), 8, true);
  REQUIRE(both.rank.source == "RANK");
  REQUIRE(both.local_world.source == "LOCAL_WORLD_SIZE");
  const Launch slurm_mpi = resolve(merged(kSlurm, kOpenMpi), 8, true);
  REQUIRE(slurm_mpi.rank.source == "SLURM_PROCID");

  const Launch explicit_ = resolve({{"RANK", "1"}, {"WORLD_SIZE", "2"}}, 0, false,
                                   ProcessGroupOptions().rank(3).world_size(4));
  REQUIRE(explicit_.rank.value == 3);
  REQUIRE(explicit_.rank.source == "options.rank");
  REQUIRE(explicit_.world_size.value == 4);
  REQUIRE(explicit_.world_size.source == "options.world_size");
  REQUIRE(explicit_.local_rank.value == 3); // rank % local world (the world: one host)

  const Launch alone = resolve({}, 0, false);
  REQUIRE(alone.rank.value == 0);
  REQUIRE(alone.world_size.value == 1);
  REQUIRE(alone.local_rank.value == 0);
  REQUIRE(alone.local_world.value == 1);
  REQUIRE(alone.backend == BackendType::Gloo);
  REQUIRE(alone.warning.empty());

  // No LOCAL_RANK: rank % local world (torchrun's and SLURM's block layout).
  REQUIRE(
      resolve({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}}, 4, true).device ==
      1);

  // Gloo asked for on a GPU host: the user's choice, no warning.
  const Launch gloo = resolve(kTorchrun, 8, true, ProcessGroupOptions().backend(BackendType::Gloo));
  REQUIRE(gloo.backend == BackendType::Gloo);
  REQUIRE(gloo.warning.empty());
}

// Guards bad input: each malformed or inconsistent value is an error naming its variable.
TEST_CASE("launch: malformed values are refused by name", "[launch_env][world1]") {
  REQUIRE_THROWS_WITH(resolve({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}, 0, false),
                      contains("init_process_group: RANK='abc' is not an integer"));
  REQUIRE_THROWS_WITH(resolve({{"RANK", "1"}, {"WORLD_SIZE", "2x"}}, 0, false),
                      contains("WORLD_SIZE='2x' is not an integer"));
  REQUIRE_THROWS_WITH(resolve({{"RANK", "4"}, {"WORLD_SIZE", "4"}}, 0, false),
                      contains("rank 4 (RANK) is out of range for world size 4 (WORLD_SIZE)"));
  REQUIRE_THROWS_WITH(resolve({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}, 0, false),
                      contains("rank -1 (RANK) is out of range"));
  REQUIRE_THROWS_WITH(resolve({{"WORLD_SIZE", "0"}}, 0, false),
                      contains("world size 0 (WORLD_SIZE) must be >= 1"));
  REQUIRE_THROWS_WITH(
      resolve({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
              0, false),
      contains("local rank 2 (LOCAL_RANK) is out of range for local world size 2 "
               "(LOCAL_WORLD_SIZE)"));
  REQUIRE_THROWS_WITH(
      resolve({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "8"}}, 0, false),
      contains("local world size 8 (LOCAL_WORLD_SIZE) must be between 1 and the "
               "world size 4 (WORLD_SIZE)"));
  for (const std::string bad : {"8(x", "8(x0)", "x8", "8,", "0", "2(x2),,1"}) {
    Env env = kSlurm;
    env["SLURM_STEP_TASKS_PER_NODE"] = bad;
    REQUIRE_THROWS_WITH(resolve(env, 8, true),
                        contains("SLURM_STEP_TASKS_PER_NODE='" + bad +
                                 "' is not a SLURM task count list (such as 8 or 2(x3),1)"));
  }
  Env mpi = kOpenMpi;
  mpi["OMPI_COMM_WORLD_LOCAL_RANK"] = "one";
  REQUIRE_THROWS_WITH(resolve(mpi, 8, true),
                      contains("OMPI_COMM_WORLD_LOCAL_RANK='one' is not an integer"));
  // NCCL asked for where it cannot run.
  REQUIRE_THROWS_WITH(
      resolve(kTorchrun, 8, false, ProcessGroupOptions().backend(BackendType::Nccl)),
      contains("backend nccl requested but dtensor was built without CUDA/NCCL"));
  REQUIRE_THROWS_WITH(resolve(kTorchrun, 0, true, ProcessGroupOptions().backend(BackendType::Nccl)),
                      contains("backend nccl requested but no CUDA device is visible"));
}
