// init_process_group, the world group and the cache of subgroups.
#include <cstdlib>
#include <map>
#include <mutex>
#include <numeric>
#include <tuple>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/library.h>

#include "internal/check.h"
#include "mesh/launch_env.h"
#include "mesh/flight_recorder.h"
#include "mesh/process_group_state.h"
#include "mesh/rank_device.h"

namespace dtensor {

namespace {

struct World {
  std::mutex mutex;
  bool initialized = false;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<const detail::GroupState> world;
  // By rank list, backend, timeout ([Note: per-group backends]) and name.
  std::map<std::tuple<std::vector<int>, BackendType, int64_t, std::string>,
           std::shared_ptr<const detail::GroupState>>
      groups;
  int local_rank = 0;
  int local_world = 1;
  int device = 0; // this rank's CUDA device: LOCAL_RANK % device count
  int64_t num_created = 0;
};

// [Note: simulated worlds] in include/dtensor/process_group.h.
struct Simulated {
  int world = 1;
  int rank = 0;
  int node = 8; // ranks per node
};

World& world_state() {
  static World w;
  return w;
}

// Ends the world: every NCCL group dtensor made is shut down (its communicators finalized
// now, not in a destructor that may run after CUDA's teardown) or aborted (no waiting), and
// all are forgotten; groups a program wrapped (wrap_group) stay its own. Holds w.mutex.
void end_world(World& w, bool abort) {
  for (const auto& [key, group] : w.groups) {
    if (group->type == BackendType::Nccl) {
      abort ? group->backend->abort() : group->backend->shutdown();
    }
  }
  w.groups.clear();
  w.world.reset();
  w.store.reset();
  w.initialized = false;
  detail::flight_world(-1, 0);
}

// [Note: communicators shut down before exit] in init_process_group.
void abort_groups_at_exit() {
  World& w = world_state();
  std::unique_lock<std::mutex> lock(w.mutex, std::try_to_lock);
  if (lock.owns_lock()) {
    end_world(w, /*abort=*/true);
  }
}

std::optional<std::string> env(const char* name) {
  return detail::process_env(name);
}

int env_int(const char* name, const std::string& value) {
  return detail::parse_env_int("init_process_group", name, value);
}

std::optional<int> env_int(const char* name) {
  auto v = env(name);
  if (!v) {
    return std::nullopt;
  }
  return env_int(name, *v);
}

// The simulated world asked for by DTENSOR_SIMULATE=WORLD[:RANK] or by backend Fake.
std::optional<Simulated> simulated_world(const ProcessGroupOptions& options) {
  Simulated s;
  if (auto node = env("DTENSOR_SIMULATE_NODE")) {
    s.node = env_int("DTENSOR_SIMULATE_NODE", *node);
    DTENSOR_CHECK(s.node >= 1, "init_process_group: DTENSOR_SIMULATE_NODE={} must be >= 1", s.node);
  }
  if (auto spec = env("DTENSOR_SIMULATE")) {
    const size_t colon = spec->find(':');
    s.world = env_int("DTENSOR_SIMULATE", spec->substr(0, colon));
    s.rank = colon == std::string::npos ? 0 : env_int("DTENSOR_SIMULATE", spec->substr(colon + 1));
  } else if (options.backend() == BackendType::Fake) {
    DTENSOR_CHECK(options.world_size().has_value(),
                  "init_process_group: backend fake needs world_size (the simulated world)");
    s.world = *options.world_size();
    s.rank = options.rank().value_or(0);
  } else {
    return std::nullopt;
  }
  DTENSOR_CHECK(s.world >= 1 && s.rank >= 0 && s.rank < s.world,
                "init_process_group: simulated rank {} of a world of {} is out of range", s.rank,
                s.world);
  s.node = std::min(s.node, s.world);
  return s;
}

c10::intrusive_ptr<c10d::Store> make_store(int rank, int world_size, const std::string& addr,
                                           std::optional<int> port,
                                           std::chrono::milliseconds timeout) {
  if (world_size == 1 && !port) {
    return c10::make_intrusive<c10d::HashStore>();
  }
  DTENSOR_CHECK(port.has_value(),
                "init_process_group: MASTER_PORT is not set (rank {} of {}, MASTER_ADDR={}); "
                "launch with torchrun or export MASTER_ADDR/MASTER_PORT",
                rank, world_size, addr);
  DTENSOR_CHECK(*port > 0 && *port < 65536, "init_process_group: MASTER_PORT={} is not a port",
                *port);
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(*port);
  opts.numWorkers = world_size;
  opts.timeout = timeout;
  // Under torchrun the agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT; workers
  // join it as clients under a per-restart prefix (what torch.distributed does too).
  if (env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True") {
    opts.isServer = false;
    opts.waitWorkers = false;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(addr, opts);
    auto attempt = env("TORCHELASTIC_RESTART_COUNT").value_or("0");
    return c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + attempt, tcp);
  }
  opts.isServer = rank == 0;
  return c10::make_intrusive<c10d::TCPStore>(addr, opts);
}

c10::DeviceType device_of(BackendType type) {
  return type == BackendType::Nccl   ? c10::DeviceType::CUDA
         : type == BackendType::Fake ? detail::kSimulatedDevice
                                     : c10::DeviceType::CPU;
}

std::shared_ptr<const detail::GroupState> make_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                     std::vector<int> ranks, int group_rank,
                                                     BackendType type,
                                                     std::chrono::milliseconds timeout) {
  auto state = std::make_shared<detail::GroupState>();
  int size = static_cast<int>(ranks.size());
  try {
    state->backend =
        type == BackendType::Nccl   ? detail::make_nccl_backend(store, group_rank, size, timeout)
        : type == BackendType::Fake ? detail::make_fake_backend(group_rank, size)
                                    : detail::make_gloo_backend(store, group_rank, size, timeout);
    if (detail::debug_detail() && type != BackendType::Fake) {
      state->backend = detail::wrap_for_debug(state->backend, store, group_rank, size, timeout);
    } else if (type == BackendType::Gloo) {
      state->backend = detail::with_gloo_fast_paths(state->backend);
    }
  } catch (const c10::Error& e) {
    DTENSOR_FAIL("creating the {} group over ranks {} (group rank {}) failed: {}", to_string(type),
                 ranks, group_rank, e.what_without_backtrace());
  }
  state->ranks = std::move(ranks);
  state->rank = group_rank;
  state->type = type;
  state->device = device_of(type);
  state->timeout = timeout;
  return state;
}

void check_nccl_usable(const std::string& what) {
  DTENSOR_CHECK(detail::nccl_available(),
                "{}: backend nccl requested but dtensor was built without CUDA/NCCL "
                "(-Dcuda=disabled)",
                what);
  DTENSOR_CHECK(detail::cuda_device_count() > 0,
                "{}: backend nccl requested but no CUDA device is visible", what);
}

// Global ranks of a group: distinct, inside the world.
void check_group_ranks(const std::string& what, const std::vector<int>& ranks, int world_size) {
  DTENSOR_CHECK(!ranks.empty(), "{}: empty rank list", what);
  std::vector<bool> seen(static_cast<size_t>(world_size), false);
  for (int r : ranks) {
    DTENSOR_CHECK(r >= 0 && r < world_size, "{}: rank {} in {} is out of range for world size {}",
                  what, r, ranks, world_size);
    DTENSOR_CHECK(!seen[static_cast<size_t>(r)], "{}: rank {} appears twice in {}", what, r, ranks);
    seen[static_cast<size_t>(r)] = true;
  }
}

World& initialized_world(const char* what) {
  World& w = world_state();
  DTENSOR_CHECK(w.initialized,
                "{}: the process group is not initialized; call "
                "dtensor::init_process_group() first",
                what);
  return w;
}

} // namespace

bool detail::debug_detail() {
  static const bool detail = [] {
    const char* v = std::getenv("TORCH_DISTRIBUTED_DEBUG");
    return v != nullptr && std::string(v) == "DETAIL";
  }();
  return detail;
}

namespace {

struct DispatchKeyConflicts {
  std::mutex mutex;
  std::vector<std::string> noted;
  std::vector<std::unique_ptr<torch::Library>> fallbacks; // registered for the process's life
};

DispatchKeyConflicts& dispatch_key_state() {
  static DispatchKeyConflicts state; // used at load, from other files' initializers
  return state;
}

} // namespace

void detail::register_fallback(c10::DispatchKey key, torch::CppFunction&& fallback,
                               const char* user) {
  auto& s = dispatch_key_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(key)) {
    s.noted.push_back(fmt::format("{} already has a fallback kernel, registered by another "
                                  "library; dtensor needs it for {}",
                                  c10::toString(key), user));
    return;
  }
  s.fallbacks.push_back(
      std::make_unique<torch::Library>(torch::Library::IMPL, "_", key, __FILE__, __LINE__));
  s.fallbacks.back()->fallback(std::move(fallback));
}

void detail::note_dispatch_key_conflict(std::string what) {
  auto& s = dispatch_key_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.noted.push_back(std::move(what));
}

std::vector<std::string> detail::dispatch_key_conflicts() {
  auto& s = dispatch_key_state();
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    out = s.noted;
  }
  const std::string name = c10::get_privateuse1_backend(/*lower_case=*/true);
  if (name != "privateuseone") {
    out.push_back(fmt::format("PrivateUse1 is the device '{}' of another library (it renamed "
                              "the backend); dtensor needs it for DTensor's handler",
                              name));
  }
  return out;
}

void detail::check_dispatch_keys() {
  const auto conflicts = dispatch_key_conflicts();
  DTENSOR_CHECK(conflicts.empty(),
                "dtensor cannot share this process with a library that uses the c10 dispatch "
                "keys it occupies (PrivateUse1, PrivateUse2, MAIA; docs/architecture.md, "
                "\"Dispatch keys\"): {}",
                fmt::join(conflicts, "; "));
}

std::string to_string(BackendType backend) {
  switch (backend) {
  case BackendType::Auto:
    return "auto";
  case BackendType::Gloo:
    return "gloo";
  case BackendType::Nccl:
    return "nccl";
  case BackendType::Fake:
    return "fake";
  }
  return "?";
}

Group::Group(std::shared_ptr<const State> state, std::string label)
    : state_(std::move(state)), label_(std::move(label)) {}

#define DTENSOR_GROUP_DEFINED(what)                                                                \
  DTENSOR_CHECK(state_ != nullptr, "Group::{}: undefined group (this rank is not a member)", what)

int Group::rank() const {
  DTENSOR_GROUP_DEFINED("rank");
  return state_->rank;
}
int Group::size() const {
  DTENSOR_GROUP_DEFINED("size");
  return static_cast<int>(state_->ranks.size());
}
const std::vector<int>& Group::ranks() const {
  DTENSOR_GROUP_DEFINED("ranks");
  return state_->ranks;
}
BackendType Group::backend_type() const {
  DTENSOR_GROUP_DEFINED("backend_type");
  return state_->type;
}
c10::DeviceType Group::device_type() const {
  DTENSOR_GROUP_DEFINED("device_type");
  return state_->device;
}
std::chrono::milliseconds Group::timeout() const {
  DTENSOR_GROUP_DEFINED("timeout");
  return state_->timeout;
}
const c10::intrusive_ptr<c10d::Backend>& Group::backend() const {
  DTENSOR_GROUP_DEFINED("backend");
  return state_->backend;
}
std::string Group::to_string() const {
  if (!state_) {
    return "Group(undefined)";
  }
  return fmt::format("{}: ranks {} ({})", label_, state_->ranks, dtensor::to_string(state_->type));
}

void init_process_group(const ProcessGroupOptions& options) {
  detail::check_dispatch_keys();
  World& w = world_state();
  std::lock_guard<std::mutex> lock(w.mutex);
  DTENSOR_CHECK(!w.initialized, "init_process_group: already initialized (rank {} of {})",
                w.world->rank, w.world->ranks.size());
  const std::optional<Simulated> simulated = simulated_world(options);
  DTENSOR_CHECK(options.timeout().count() > 0, "init_process_group: timeout {} ms must be > 0",
                options.timeout().count());
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world = 1;
  int device = 0;
  BackendType type = BackendType::Fake;
  if (simulated) {
    rank = simulated->rank;
    world_size = simulated->world;
    local_rank = rank % simulated->node;
    local_world = simulated->node;
  } else {
    // [Note: the launch environment] in lib/mesh/launch_env.h.
    const detail::Launch launch = detail::resolve_launch(
        options, detail::process_env, detail::cuda_device_count(), detail::nccl_available());
    rank = launch.rank.value;
    world_size = launch.world_size.value;
    local_rank = launch.local_rank.value;
    local_world = launch.local_world.value;
    device = launch.device;
    type = launch.backend;
    if (!launch.warning.empty()) {
      TORCH_WARN_ONCE(launch.warning);
    }
  }
  std::string addr = options.master_addr().value_or(env("MASTER_ADDR").value_or("127.0.0.1"));
  std::optional<int> port = options.master_port();
  if (!port) {
    port = env_int("MASTER_PORT");
  }
  if (type == BackendType::Nccl) {
    detail::bind_rank_device(device);
  }

  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = simulated ? c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::HashStore>())
                      : make_store(rank, world_size, addr, port, options.timeout());
  } catch (const c10::Error& e) {
    DTENSOR_FAIL("init_process_group: rendezvous at {}:{} failed (rank {} of {}): {}", addr,
                 port.value_or(0), rank, world_size, e.what_without_backtrace());
  }
  std::vector<int> all(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    all[static_cast<size_t>(r)] = r;
  }
  auto world = make_group(c10::make_intrusive<c10d::PrefixStore>("dtensor/world/", store), all,
                          rank, type, options.timeout());
  w.store = store;
  w.world = world;
  w.groups.clear();
  w.groups[{all, type, options.timeout().count(), ""}] = world;
  w.local_rank = local_rank;
  w.local_world = local_world;
  w.device = device;
  w.num_created = 1;
  w.initialized = true;
  detail::flight_world(rank, world_size);
  // [Note: communicators shut down before exit]
  // ProcessGroupNCCL's destructor aborts its communicators and waits on the CUDA runtime;
  // run from static destruction (a program that never calls destroy_process_group, or a
  // group still referenced by a static) it finds the CUDA driver shutting down and
  // terminates the process after a clean run (seen on a GPU, docs/testing.md). An exit
  // handler registered now runs before the CUDA runtime's teardown, which was registered
  // when libcudart loaded, and aborts every NCCL group first: abort, not shutdown, and
  // only if the state is free, so that a process exiting while a collective or a group's
  // rendezvous is stuck (a peer gone) exits instead of waiting on it.
  static const bool registered = std::atexit(abort_groups_at_exit) == 0;
  (void)registered;
}

bool is_initialized() {
  World& w = world_state();
  std::lock_guard<std::mutex> lock(w.mutex);
  return w.initialized;
}

void destroy_process_group() {
  World& w = world_state();
  std::lock_guard<std::mutex> lock(w.mutex);
  end_world(w, /*abort=*/false); // as PyTorch's destroy_process_group: shut down
}

int get_rank() {
  return initialized_world("get_rank").world->rank;
}

int get_world_size() {
  return static_cast<int>(initialized_world("get_world_size").world->ranks.size());
}

int get_local_rank() {
  return initialized_world("get_local_rank").local_rank;
}

BackendType get_backend() {
  return initialized_world("get_backend").world->type;
}

bool is_simulated() {
  return get_backend() == BackendType::Fake;
}

c10::Device detail::rank_device(c10::DeviceType type) {
  if (type == c10::kCUDA) {
    World& w = world_state();
    return {c10::kCUDA, static_cast<c10::DeviceIndex>(w.initialized ? w.device : 0)};
  }
  return type == c10::kCPU ? c10::Device(type) : c10::Device(type, 0); // the simulated device
}

at::Tensor detail::to_rank_device(const at::Tensor& t, c10::DeviceType mesh_type,
                                  const std::string& what, const std::string& mesh) {
  if (t.is_meta() || t.device().type() == mesh_type) {
    return t;
  }
  const auto real = [](c10::DeviceType d) { return d == c10::kCPU || d == c10::kCUDA; };
  DTENSOR_CHECK(real(t.device().type()) && real(mesh_type), "{}: tensor on {} but the mesh is {}",
                what, t.device().str(), mesh);
  return t.to(rank_device(mesh_type));
}

c10::Device default_device() {
  switch (get_backend()) {
  case BackendType::Nccl:
    return detail::rank_device(c10::kCUDA);
  case BackendType::Fake:
    return {detail::kSimulatedDevice, 0};
  default:
    return {c10::kCPU};
  }
}

Group world_group() {
  return Group(initialized_world("world_group").world, "world");
}

int64_t num_groups_created() {
  return initialized_world("num_groups_created").num_created;
}

Group detail::new_background_group(const std::string& label) {
  World& w = initialized_world("new_background_group");
  std::lock_guard<std::mutex> lock(w.mutex);
  std::vector<int> all(w.world->ranks.size());
  std::iota(all.begin(), all.end(), 0);
  auto prefix = fmt::format("dtensor/background/{}/", label);
  auto state = make_group(
      c10::make_intrusive<c10d::PrefixStore>(prefix, w.store), all, w.world->rank,
      w.world->type == BackendType::Fake ? BackendType::Fake : BackendType::Gloo, w.world->timeout);
  ++w.num_created;
  return Group(state, label);
}

Group new_group(const std::vector<int>& ranks, std::string label) {
  return new_group(ranks, std::move(label), GroupOptions());
}

Group new_group(const std::vector<int>& ranks, std::string label, const GroupOptions& options) {
  World& w = initialized_world("new_group");
  std::lock_guard<std::mutex> lock(w.mutex);
  int world_size = static_cast<int>(w.world->ranks.size());
  check_group_ranks("new_group", ranks, world_size);
  if (label.empty()) {
    label = fmt::format("ranks{}", ranks);
  }
  BackendType type = options.backend() == BackendType::Auto ? w.world->type : options.backend();
  DTENSOR_CHECK((type == BackendType::Fake) == (w.world->type == BackendType::Fake),
                "new_group({}, '{}'): backend {} in a {} world: a simulated world's groups are "
                "all fake, a real world's none",
                ranks, label, to_string(type), to_string(w.world->type));
  auto timeout = options.timeout().value_or(w.world->timeout);
  DTENSOR_CHECK(timeout.count() > 0, "new_group({}, '{}'): timeout {} ms must be > 0", ranks, label,
                timeout.count());
  int me = w.world->rank;
  auto it = std::find(ranks.begin(), ranks.end(), me);
  if (it == ranks.end()) {
    return Group();
  }
  std::tuple<std::vector<int>, BackendType, int64_t, std::string> key{ranks, type, timeout.count(),
                                                                      options.name()};
  if (auto cached = w.groups.find(key); cached != w.groups.end()) {
    return Group(cached->second, std::move(label));
  }
  if (type == BackendType::Nccl) {
    check_nccl_usable(fmt::format("new_group({}, '{}')", ranks, label));
  }
  // Members rendezvous under a prefix named after the rank list (and the backend and
  // timeout where they are not the world's): the same list always names the same
  // communicator, and disjoint lists never wait on each other.
  std::string prefix = fmt::format("dtensor/group/{}/", fmt::join(ranks, ","));
  if (type != w.world->type || timeout != w.world->timeout) {
    prefix += fmt::format("{}-{}ms/", to_string(type), timeout.count());
  }
  if (!options.name().empty()) {
    prefix += fmt::format("name-{}/", options.name());
  }
  auto state = make_group(c10::make_intrusive<c10d::PrefixStore>(prefix, w.store), ranks,
                          static_cast<int>(it - ranks.begin()), type, timeout);
  w.groups[key] = state;
  ++w.num_created;
  return Group(state, std::move(label));
}

Group wrap_group(const c10::intrusive_ptr<c10d::Backend>& backend, const std::vector<int>& ranks,
                 std::string label) {
  World& w = initialized_world("wrap_group");
  std::lock_guard<std::mutex> lock(w.mutex);
  if (label.empty()) {
    label = fmt::format("ranks{}", ranks);
  }
  std::string what = fmt::format("wrap_group(ranks={}, label='{}')", ranks, label);
  DTENSOR_CHECK(backend, "{}: the backend is null", what);
  check_group_ranks(what, ranks, static_cast<int>(w.world->ranks.size()));
  const std::string name = backend->getBackendName();
  BackendType type = name == "gloo"   ? BackendType::Gloo
                     : name == "nccl" ? BackendType::Nccl
                     : name == "fake" ? BackendType::Fake
                                      : BackendType::Auto;
  DTENSOR_CHECK(type != BackendType::Auto,
                "{}: backend '{}' is not one dtensor drives (gloo, nccl, fake)", what, name);
  DTENSOR_CHECK(backend->getSize() == static_cast<int>(ranks.size()),
                "{}: the {} backend has {} ranks, the rank list {}", what, name, backend->getSize(),
                ranks.size());
  int group_rank = backend->getRank();
  DTENSOR_CHECK(group_rank >= 0 && group_rank < static_cast<int>(ranks.size()) &&
                    ranks[static_cast<size_t>(group_rank)] == w.world->rank,
                "{}: this process is global rank {} but the backend's rank {} maps to {}", what,
                w.world->rank, group_rank,
                group_rank >= 0 && group_rank < static_cast<int>(ranks.size())
                    ? fmt::format("global rank {}", ranks[static_cast<size_t>(group_rank)])
                    : std::string("no rank of the list"));
  auto state = std::make_shared<detail::GroupState>();
  state->backend = backend;
  state->ranks = ranks;
  state->rank = group_rank;
  state->type = type;
  state->device = device_of(type);
  state->timeout = w.world->timeout;
  return Group(state, std::move(label));
}

} // namespace dtensor
