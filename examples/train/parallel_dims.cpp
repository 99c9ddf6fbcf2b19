// The recipe's ParallelDims (parallel_dims.h): the degrees from the flags, every one checked
// against the world, the model and the batch before any group is made, with the same error on
// every rank; the world mesh.
#include "parallel_dims.h"

#include <cmath>

#include <string>
#include <initializer_list>
#include <utility>

#include <dtensor/collectives.h>
#include <dtensor/pipeline_schedule.h>
#include <dtensor/process_group.h>

#include "recipe_model.h"

namespace dtensor::train {

namespace {

// What is wrong with --pp and the flags beside it for `world` ranks ("" when nothing).
std::string pipeline_flag_error(const Flags& f, int64_t world) {
  if (f.pp < 1 || world % f.pp != 0) {
    return "--pp " + std::to_string(f.pp) + " does not divide the " + std::to_string(world) +
           " ranks";
  }
  if (f.microbatches < 0) {
    return "--microbatches must be positive";
  }
  if (f.pp == 1 && f.microbatches > 0) {
    return "--microbatches needs --pp";
  }
  return "";
}

// Each pipeline stage holds one block at least (the model's layers are known from the flags
// or the Hugging Face folder's config.json).
void check_stages(const Flags& f) {
  if (f.pp == 1) {
    return;
  }
  const int64_t stages = f.pp * (is_single_stage(schedule_kind(f.pp_schedule)) ? 1 : 2);
  const int64_t layers = recipe_model_args(f, 1).n_layers();
  if (layers < stages) {
    usage(std::to_string(layers) + " layers cannot fill " + std::to_string(stages) +
          " pipeline stages (" + f.pp_schedule + " on " + std::to_string(f.pp) +
          " ranks): one block each at least");
  }
}

bool is_moe_flavor(const std::string& preset) {
  return preset == "qwen3-moe" || preset == "deepseek-v3" || preset == "qwen3-30b-a3b" ||
         preset == "deepseek-v3-16b";
}

// Expert parallelism borrows its ranks from dp_shard x cp x tp (models/llama3/parallelize.h).
void check_ep(const Flags& f) {
  if (f.ep_dispatch == "capacity" &&
      !(f.ep_capacity_factor > 0 && std::isfinite(f.ep_capacity_factor))) {
    usage("--ep-capacity-factor " + std::to_string(f.ep_capacity_factor) +
          " must be a positive number (capacity dispatch's buffers hold it x a rank's rows / ep)");
  }
  if (f.ep_overlap && f.ep_dispatch != "capacity") {
    usage("--ep-overlap splits capacity dispatch's buffers into two chunks: it needs "
          "--ep-dispatch capacity");
  }
  if (f.ep == 1) {
    return;
  }
  // A Hugging Face folder's model has experts when its config.json says so.
  const bool moe = f.init_from_hf.empty() ? is_moe_flavor(f.preset)
                                          : recipe_model_args(f, 1).moe().has_value();
  if (f.ep < 1 || !moe) {
    usage("--ep " + std::to_string(f.ep) + " needs a mixture-of-experts model (--model " +
          "qwen3-moe|deepseek-v3|qwen3-30b-a3b|deepseek-v3-16b, or an --init-from-hf folder " +
          "with experts)" + (f.preset.empty() ? "" : ", not " + f.preset));
  }
  const int64_t borrowable = f.mesh[1] * f.cp * f.mesh[2];
  if (borrowable % f.ep != 0) {
    usage("--ep " + std::to_string(f.ep) + " does not divide dp_shard x cp x tp = " +
          std::to_string(f.mesh[1]) + " x " + std::to_string(f.cp) + " x " +
          std::to_string(f.mesh[2]) + ", the ranks expert parallelism borrows");
  }
  if (!f.init_from_hf.empty()) {
    const int64_t experts = recipe_model_args(f, 1).moe()->num_experts();
    if (experts % f.ep != 0) {
      usage(f.init_from_hf + "'s " + std::to_string(experts) + " experts do not divide over --ep " +
            std::to_string(f.ep));
    }
  } else if (f.preset == "qwen3-moe" || f.preset == "deepseek-v3") {
    if (f.experts % f.ep != 0) {
      usage("--experts " + std::to_string(f.experts) + " do not divide over --ep " +
            std::to_string(f.ep));
    }
  }
}

// torchtitan's gradient accumulation: --batch (training.global_batch_size) in steps of
// --local-batch (training.local_batch_size) rows on each data-parallel rank; without --batch
// one step of local_batch rows on each.
void resolve_accumulation(Flags& f) {
  const int64_t dp = f.mesh[0] * f.mesh[1];
  if (f.local_batch < 0) {
    usage("--local-batch (training.local_batch_size) " + std::to_string(f.local_batch) +
          " must be positive (0: no accumulation)");
  }
  if (f.local_batch == 0) {
    f.accumulation = 1;
    return;
  }
  if (!f.batch_given) {
    f.batch = f.local_batch * dp;
  }
  if (f.batch <= 0 || f.batch % (f.local_batch * dp) != 0) {
    usage("--batch (training.global_batch_size) " + std::to_string(f.batch) +
          " is not a multiple of --local-batch (training.local_batch_size) " +
          std::to_string(f.local_batch) + " x the " + std::to_string(dp) +
          " data-parallel ranks");
  }
  f.accumulation = f.batch / (f.local_batch * dp);
}

} // namespace

ParallelDims resolve_parallel_dims(Flags& f, int64_t world) {
  if (f.cp < 1 || world % f.cp != 0) {
    usage("--cp " + std::to_string(f.cp) + " does not divide the " + std::to_string(world) +
          " ranks");
  }
  if (const std::string why = pipeline_flag_error(f, world); !why.empty()) {
    usage(why);
  }
  if (const std::string why = mesh_from_degrees(f, world / (f.cp * f.pp)); !why.empty()) {
    usage(why);
  }
  if (f.mesh.empty()) {
    f.mesh = default_mesh(world / (f.cp * f.pp));
  }
  if (f.pp * f.mesh[0] * f.mesh[1] * f.cp * f.mesh[2] != world) {
    usage("--mesh " + std::to_string(f.mesh[0]) + "x" + std::to_string(f.mesh[1]) + "x" +
          std::to_string(f.mesh[2]) + " with --cp " + std::to_string(f.cp) + " and --pp " +
          std::to_string(f.pp) + " does not cover the " + std::to_string(world) + " ranks");
  }
  if (f.cp > 1 && f.seq % (2 * f.cp * f.mesh[2]) != 0) {
    usage("--seq " + std::to_string(f.seq) +
          " is not a multiple of 2 x cp x tp = " + std::to_string(2 * f.cp * f.mesh[2]) +
          " (2 x cp chunks or more for --cp-balance, then sequence parallelism over tp)");
  }
  resolve_accumulation(f);
  if (f.batch % (f.mesh[0] * f.mesh[1] * f.accumulation * pipeline_microbatches(f)) != 0) {
    usage("--batch " + std::to_string(f.batch) + " is not a multiple of the " +
          std::to_string(f.mesh[0] * f.mesh[1]) + " data-parallel ranks" +
          (f.accumulation > 1 ? " x " + std::to_string(f.accumulation) + " accumulation steps"
                              : "") +
          (f.pp > 1 ? " x " + std::to_string(pipeline_microbatches(f)) + " pipeline microbatches"
                    : ""));
  }
  if (f.float8_all_gather && (f.float8 != "tensorwise" || f.mesh[2] != 1)) {
    usage("--float8-all-gather needs --float8 tensorwise (one scale per weight) and tp 1 (the "
          "float8 all-gather does not compose with tensor parallelism); got --float8 " +
          f.float8 + " and tp " + std::to_string(f.mesh[2]));
  }
  check_ep(f);
  check_stages(f);
  ParallelDims d;
  d.pp = f.pp;
  d.dp_replicate = f.mesh[0];
  d.dp_shard = f.mesh[1];
  d.cp = f.cp;
  d.tp = f.mesh[2];
  d.ep = f.ep;
  d.world = world;
  return d;
}

int64_t pipeline_microbatches(const Flags& f) {
  if (f.pp == 1) {
    return 1; // no pipeline: the rank's rows in one piece
  }
  return f.microbatches > 0 ? f.microbatches : 2 * f.pp;
}

std::vector<std::string> ParallelDims::names() const {
  std::vector<std::string> n;
  for (const auto& [name, size] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"pp", pp}, {"dp_replicate", 0}, {"dp_shard", 0}, {"cp", cp}, {"tp", 0}}) {
    if (size != 1) { // 0: always there
      n.emplace_back(name);
    }
  }
  return n;
}

std::vector<int64_t> ParallelDims::shape() const {
  std::vector<int64_t> s;
  for (const std::string& name : names()) {
    s.push_back(name == "pp"             ? pp
                : name == "dp_replicate" ? dp_replicate
                : name == "dp_shard"     ? dp_shard
                : name == "cp"           ? cp
                                         : tp);
  }
  return s;
}

DeviceMesh ParallelDims::build_mesh(c10::DeviceType kind) const {
  const DeviceMesh mesh = init_device_mesh(kind, shape(), names());
  for (const std::string& name : names()) {
    mesh[name].get_group();
  }
  barrier(world_group());
  return mesh;
}

} // namespace dtensor::train
