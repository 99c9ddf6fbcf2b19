#pragma once

#include <functional>
#include <optional>
#include <string>

#include <dtensor/process_group.h>

namespace dtensor::detail {

// [Note: the launch environment]
// init_process_group finds its rank, world size, local rank and local world size (the ranks
// on this host) in what the launcher exported, each on its own, in this order:
//   1. ProcessGroupOptions' rank and world_size, where given;
//   2. torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
//   3. inside an srun step (SLURM_STEP_ID set; a batch script or an salloc shell is one
//      process, whatever SLURM_NTASKS says): SLURM_PROCID, SLURM_STEP_NUM_TASKS or
//      SLURM_NTASKS, SLURM_LOCALID, and this node's entry (SLURM_NODEID) of
//      SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE ("8", or the
//      compressed "2(x3),1": 2 tasks on each of three nodes, then 1); the step's own
//      variables first, as srun leaves the job's SLURM_NTASKS_PER_NODE in place when a step
//      runs fewer tasks;
//   4. Open MPI's OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
//   5. defaults: rank 0 of 1; a local world size of the whole world (one host); a local rank
//      of RANK % local world size.
// Backend Auto is NCCL whenever the build has NCCL and a CUDA device is visible, as PyTorch
// picks NCCL for CUDA tensors whatever the local world; each rank's device is
// LOCAL_RANK % device count. A warning (printed once per process) says when a job with CUDA
// devices runs on Gloo, or when more ranks than devices share a host (NCCL refuses two ranks
// of one communicator on one device); malformed values are errors naming the variable.

// An environment: the value of a variable, nullopt when it is unset or empty.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// This process's environment.
std::optional<std::string> process_env(const std::string& name);

// `value` of variable `name` as an integer: "`what`: NAME='value' is not an integer" otherwise.
int parse_env_int(const std::string& what, const std::string& name, const std::string& value);

// One resolved quantity and where it came from: the variable read ("SLURM_PROCID"),
// "options.rank" / "options.world_size", or "default".
struct LaunchValue {
  int value = 0;
  std::string source;
  std::string detail; // how the source gave the value: "SLURM_TASKS_PER_NODE='2(x2)' at
                      // SLURM_NODEID=1"; "" where the value is the variable's own
};

struct Launch {
  LaunchValue rank, world_size, local_rank, local_world;
  BackendType backend = BackendType::Gloo; // the requested one, Auto resolved
  int device = 0;      // this rank's CUDA device: LOCAL_RANK % device count (0 without one)
  std::string warning; // empty, or why the job is slower than it could be or will fail
};

// The launch of this rank from `env`, `cuda_devices` visible CUDA devices and whether the
// build has NCCL ([Note: the launch environment]). Throws dtensor::Error on malformed or
// inconsistent values. Not for simulated worlds.
Launch resolve_launch(const ProcessGroupOptions& options, const EnvLookup& env, int cuda_devices,
                      bool nccl_built);

} // namespace dtensor::detail
