#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

namespace c10d {
class Backend;
class Store;
} // namespace c10d

namespace dtensor {

// Which c10d engine carries the collectives.
enum class BackendType {
  Auto, // NCCL when built with CUDA and a GPU is visible, Gloo otherwise
  Gloo, // c10d::ProcessGroupGloo (CPU tensors)
  Nccl, // c10d::ProcessGroupNCCL (CUDA tensors)
  Fake, // a simulated world: every collective completes at once and moves nothing; one
        // process plays one rank of any world size on tensors without values ([Note: simulated
        // worlds], docs/simulation.md)
};

std::string to_string(BackendType backend);

// Options of init_process_group(). What is not set here comes from the launcher: torchrun's RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, else SLURM's or Open MPI's (docs/device_mesh.md,
// "Launching"), and MASTER_ADDR, MASTER_PORT; so the same program runs under torchrun, srun,
// mpirun or alone (no variables: a world of one rank). A rank's GPU: LOCAL_RANK % device count.
//
// [Note: simulated worlds] DTENSOR_SIMULATE=WORLD[:RANK] (or backend Fake with world_size and
// rank) makes this process rank RANK (default 0) of a simulated world of WORLD ranks: no
// rendezvous, every group on the fake backend, every mesh on the simulated device (its tensors
// have shapes, dtypes and placements, no values; nothing is computed; [Note: the simulated
// device] in lib/sim/sim_device.cpp). The program runs unchanged
// where it takes its device from default_device() or its meshes; CommDebugMode records every
// collective as the real run would issue it. DTENSOR_SIMULATE_NODE (default 8) is the ranks
// per node, which gives LOCAL_RANK.
struct ProcessGroupOptions {
  TORCH_ARG(BackendType, backend) = BackendType::Auto;
  // Timeout of the rendezvous and of every collective; a rank that waits longer fails.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  TORCH_ARG(std::optional<int>, rank) = std::nullopt;
  TORCH_ARG(std::optional<int>, world_size) = std::nullopt;
  TORCH_ARG(std::optional<std::string>, master_addr) = std::nullopt;
  TORCH_ARG(std::optional<int>, master_port) = std::nullopt;
};

// A handle on one c10d communicator: the ranks it spans (global ranks, in group-rank
// order) and a label that CommDebugMode uses to attribute its collectives ("world",
// a mesh dimension name such as "dp", ...). Copies share the communicator.
class Group {
 public:
  struct State; // one c10d communicator inside the library (lib/mesh/process_group_state.h)

  Group() = default;
  Group(std::shared_ptr<const State> state, std::string label);

  bool defined() const { return state_ != nullptr; }
  int rank() const; // this process's rank inside the group
  int size() const;
  const std::vector<int>& ranks() const; // global ranks, index = group rank
  const std::string& label() const { return label_; }
  Group with_label(std::string label) const { return Group(state_, std::move(label)); }
  BackendType backend_type() const;
  c10::DeviceType device_type() const; // kCPU for Gloo, kCUDA for NCCL
  std::chrono::milliseconds timeout() const;
  // The underlying c10d backend, for what dtensor does not wrap. Collectives issued on it
  // directly bypass CommDebugMode.
  const c10::intrusive_ptr<c10d::Backend>& backend() const;
  std::string to_string() const; // "dp: ranks [0, 2] (gloo)"

  bool operator==(const Group& other) const { return state_ == other.state_; }
  bool operator!=(const Group& other) const { return !(*this == other); }

 private:
  std::shared_ptr<const State> state_;
  std::string label_;
};

// Joins the default (world) group. Collective across all ranks; call once per process.
void init_process_group(const ProcessGroupOptions& options = {});
bool is_initialized();
// Drops the world group and every cached subgroup.
void destroy_process_group();

int get_rank();
int get_world_size();
int get_local_rank(); // LOCAL_RANK (or SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK)
BackendType get_backend();
Group world_group();
// Where this rank's tensors live: cuda:(LOCAL_RANK % device count) on NCCL, the simulated
// device (maia:0) in a simulated world, cpu otherwise.
c10::Device default_device();
// A simulated world ([Note: simulated worlds]).
bool is_simulated();

// The group over `ranks` (global ranks, in the given order), created on first use and
// cached: every rank in `ranks` must call it, in the same order relative to other group
// creations. Ranks not in `ranks` get an undefined Group and must not call collectives on it.
Group new_group(const std::vector<int>& ranks, std::string label = "");

// [Note: per-group backends] A group's backend and timeout may differ from the world's: a
// CPU mesh beside CUDA ones in an NCCL world runs on Gloo, a slow dimension gets a longer
// timeout (PyTorch's init_device_mesh(..., backend_override=...)). Auto is the world's backend
// (its timeout for nullopt). Groups are cached by rank list, backend, timeout and name.
struct GroupOptions {
  TORCH_ARG(BackendType, backend) = BackendType::Auto;
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout) = std::nullopt;
  // A communicator of its own for these ranks when not empty (another name, another
  // communicator over the same ranks): pipelining's per-edge groups.
  TORCH_ARG(std::string, name) = "";
};
Group new_group(const std::vector<int>& ranks, std::string label, const GroupOptions& options);

// [Note: existing communicators] A c10d communicator the caller created (a framework that owns
// its process groups: its own store, its own ProcessGroupGloo / ProcessGroupNCCL, or
// ProcessGroup::getBackend(device) of a c10d::ProcessGroup) as a dtensor Group, for
// DeviceMesh::from_group and the collectives. `ranks` are the group's members as global
// ranks (dtensor's world), in group-rank order; the backend's rank and size must agree with
// them. Its collectives go through dtensor's choke point like any other (CommDebugMode
// counts them under `label`); dtensor never creates, caches or destroys it. Backends
// dtensor drives: gloo, nccl, fake (c10d::Backend::getBackendName()); the timeout is the
// world's. Not collective.
Group wrap_group(const c10::intrusive_ptr<c10d::Backend>& backend, const std::vector<int>& ranks,
                 std::string label = "");

// Number of c10d communicators this process has created so far (world included).
int64_t num_groups_created();

} // namespace dtensor
