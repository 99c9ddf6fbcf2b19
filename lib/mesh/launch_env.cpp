// The launch of a rank: rank, world size, local rank and local world size from the launcher's
// variables, and the backend that BackendType::Auto picks ([Note: the launch environment] in
// launch_env.h).
#include "mesh/launch_env.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <vector>

#include "internal/check.h"

namespace dtensor::detail {

namespace {

constexpr const char* kWhat = "init_process_group";

// Every variable read below, in order, and the devices' own, for the warning's list of what
// was set.
const std::vector<std::string> kLauncherVariables = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "CUDA_VISIBLE_DEVICES",
};

std::optional<int> parse_int(const std::string& s) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) {
    return std::nullopt;
  }
  return v;
}

// SLURM's tasks per node, one entry per node: "2(x3),1" is {2, 2, 2, 1}.
std::vector<int> expand_task_counts(const std::string& name, const std::string& value) {
  const auto bad = [&] {
    DTENSOR_FAIL("{}: {}='{}' is not a SLURM task count list (such as 8 or 2(x3),1)", kWhat, name,
                 value);
  };
  std::vector<int> counts;
  size_t pos = 0;
  while (true) {
    const size_t comma = value.find(',', pos);
    std::string item = value.substr(pos, comma == std::string::npos ? comma : comma - pos);
    int repeat = 1;
    if (const size_t paren = item.find("(x"); paren != std::string::npos) {
      const auto r = item.back() == ')' ? parse_int(item.substr(paren + 2, item.size() - paren - 3))
                                        : std::nullopt;
      if (!r || *r < 1) {
        bad();
      }
      repeat = *r;
      item.resize(paren);
    }
    const auto count = parse_int(item);
    if (!count || *count < 1) {
      bad();
    }
    counts.insert(counts.end(), static_cast<size_t>(repeat), *count);
    if (comma == std::string::npos) {
      return counts;
    }
    pos = comma + 1;
  }
}

// This node's entry of a SLURM tasks-per-node list (SLURM_NODEID picks it where they differ).
std::optional<LaunchValue> tasks_on_this_node(const EnvLookup& env, const std::string& name) {
  const auto value = env(name);
  if (!value) {
    return std::nullopt;
  }
  const std::vector<int> counts = expand_task_counts(name, *value);
  const std::string listed = fmt::format("{}='{}'", name, *value);
  if (std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; })) {
    return LaunchValue{counts[0], name, counts.size() > 1 ? listed : ""};
  }
  const auto node = env("SLURM_NODEID");
  DTENSOR_CHECK(node.has_value(),
                "{}: {} gives different task counts per node, but SLURM_NODEID (which node this "
                "is) is not set",
                kWhat, listed);
  const int id = parse_env_int(kWhat, "SLURM_NODEID", *node);
  DTENSOR_CHECK(id >= 0 && static_cast<size_t>(id) < counts.size(),
                "{}: SLURM_NODEID={} is out of range for {} ({} nodes)", kWhat, id, listed,
                counts.size());
  return LaunchValue{counts[static_cast<size_t>(id)], name,
                     fmt::format("{} at SLURM_NODEID={}", listed, id)};
}

// The first of `names` that is set.
std::optional<LaunchValue> first_set(const EnvLookup& env, const std::vector<std::string>& names) {
  for (const auto& name : names) {
    if (name.find("TASKS_PER_NODE") != std::string::npos) {
      if (auto v = tasks_on_this_node(env, name)) {
        return v;
      }
    } else if (auto value = env(name)) {
      return LaunchValue{parse_env_int(kWhat, name, *value), name, ""};
    }
  }
  return std::nullopt;
}

// "9 (SLURM_PROCID)", "2 (SLURM_TASKS_PER_NODE='2(x2)' at SLURM_NODEID=1)".
std::string describe(const LaunchValue& v) {
  return fmt::format("{} ({})", v.value, v.detail.empty() ? v.source : v.detail);
}

std::string variables_seen(const EnvLookup& env) {
  std::vector<std::string> seen;
  for (const auto& name : kLauncherVariables) {
    if (auto value = env(name)) {
      seen.push_back(fmt::format("{}={}", name, *value));
    }
  }
  return seen.empty() ? "no launcher variable is set"
                      : fmt::format("variables seen: {}", fmt::join(seen, " "));
}

void check_ranges(const Launch& l) {
  DTENSOR_CHECK(l.world_size.value >= 1, "{}: world size {} must be >= 1", kWhat,
                describe(l.world_size));
  DTENSOR_CHECK(l.rank.value >= 0 && l.rank.value < l.world_size.value,
                "{}: rank {} is out of range for world size {}", kWhat, describe(l.rank),
                describe(l.world_size));
  DTENSOR_CHECK(l.local_world.value >= 1 && l.local_world.value <= l.world_size.value,
                "{}: local world size {} must be between 1 and the world size {}", kWhat,
                describe(l.local_world), describe(l.world_size));
  DTENSOR_CHECK(l.local_rank.value >= 0 && l.local_rank.value < l.local_world.value,
                "{}: local rank {} is out of range for local world size {}", kWhat,
                describe(l.local_rank), describe(l.local_world));
}

std::string warning_of(const Launch& l, BackendType requested, int cuda_devices,
                       const EnvLookup& env) {
  std::string why;
  if (requested == BackendType::Auto && l.backend == BackendType::Gloo && cuda_devices > 0) {
    why = fmt::format("{} CUDA device(s) are visible but dtensor was built without NCCL "
                      "(-Dcuda=disabled), so backend auto chose gloo: collectives run on the "
                      "CPU and the world's meshes are cpu meshes; build with -Dcuda=enabled for "
                      "NCCL, or ask for BackendType::Gloo to choose Gloo knowingly",
                      cuda_devices);
  } else if (l.backend == BackendType::Nccl && l.local_world.value > cuda_devices) {
    why = fmt::format("local world size {} is larger than the {} visible CUDA device(s): ranks "
                      "of one host share devices (local ranks 0 and {} both bind cuda:0, "
                      "LOCAL_RANK % device count) and NCCL refuses two ranks of one communicator "
                      "on one device; start one rank per device, or set LOCAL_WORLD_SIZE to the "
                      "ranks on each host (nothing is shared where each rank sees devices of its "
                      "own, CUDA_VISIBLE_DEVICES set per rank)",
                      describe(l.local_world), cuda_devices, cuda_devices);
  } else {
    return "";
  }
  return fmt::format("{} (rank {} of {}, local rank {}): {}; {}", kWhat, l.rank.value,
                     l.world_size.value, l.local_rank.value, why, variables_seen(env));
}

} // namespace

std::optional<std::string> process_env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr || *v == '\0') {
    return std::nullopt;
  }
  return std::string(v);
}

int parse_env_int(const std::string& what, const std::string& name, const std::string& value) {
  const auto v = parse_int(value);
  DTENSOR_CHECK(v.has_value(), "{}: {}='{}' is not an integer", what, name, value);
  return *v;
}

Launch resolve_launch(const ProcessGroupOptions& options, const EnvLookup& env, int cuda_devices,
                      bool nccl_built) {
  // [Note: the launch environment]: SLURM's variables only in a task srun started.
  const bool slurm = env("SLURM_STEP_ID").has_value();
  const auto names = [slurm](std::string torchrun, std::vector<std::string> slurm_names,
                             std::string mpi) {
    std::vector<std::string> out{std::move(torchrun)};
    if (slurm) {
      out.insert(out.end(), slurm_names.begin(), slurm_names.end());
    }
    out.push_back(std::move(mpi));
    return out;
  };
  Launch l;
  l.rank = options.rank() ? LaunchValue{*options.rank(), "options.rank", ""}
                          : first_set(env, names("RANK", {"SLURM_PROCID"}, "OMPI_COMM_WORLD_RANK"))
                                .value_or(LaunchValue{0, "default", ""});
  l.world_size = options.world_size()
                     ? LaunchValue{*options.world_size(), "options.world_size", ""}
                     : first_set(env, names("WORLD_SIZE", {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"},
                                            "OMPI_COMM_WORLD_SIZE"))
                           .value_or(LaunchValue{1, "default", ""});
  const auto local_world_names =
      names("LOCAL_WORLD_SIZE",
            {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"},
            "OMPI_COMM_WORLD_LOCAL_SIZE");
  l.local_world = first_set(env, local_world_names)
                      .value_or(LaunchValue{l.world_size.value, "default",
                                            fmt::format("the world size: none of {} is set",
                                                        fmt::join(local_world_names, ", "))});
  l.local_rank =
      first_set(env, names("LOCAL_RANK", {"SLURM_LOCALID"}, "OMPI_COMM_WORLD_LOCAL_RANK"))
          .value_or(LaunchValue{l.local_world.value > 0 ? l.rank.value % l.local_world.value : 0,
                                "default", "rank % local world size"});
  check_ranges(l);

  const BackendType requested = options.backend();
  l.backend = requested;
  if (requested == BackendType::Auto) {
    l.backend = nccl_built && cuda_devices > 0 ? BackendType::Nccl : BackendType::Gloo;
  } else if (requested == BackendType::Nccl) {
    DTENSOR_CHECK(nccl_built,
                  "{}: backend nccl requested but dtensor was built without CUDA/NCCL "
                  "(-Dcuda=disabled)",
                  kWhat);
    DTENSOR_CHECK(cuda_devices > 0, "{}: backend nccl requested but no CUDA device is visible",
                  kWhat);
  }
  l.device = cuda_devices > 0 ? l.local_rank.value % cuda_devices : 0;
  l.warning = warning_of(l, requested, cuda_devices, env);
  return l;
}

} // namespace dtensor::detail
