// torchtitan's side of job files (config.h): the keys examples/train reads without acting on them,
// torchtitan's defaults for what a file leaves out, and its flavor names.
#include "config.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace dtensor::train {

// [Note: torchtitan's keys we do not implement] The keys of torchtitan's JobConfig of the TOML
// era (its last TOML release, 2026-02; torchtitan now configures jobs in Python) that this
// recipe does not act on. A job file written for torchtitan holds them; they are read, named
// in one warning and otherwise ignored, so the file loads. A key in neither list is an error.
const std::vector<std::string>& torchtitan_only_keys() {
  static const std::vector<std::string> keys{
      "job.description",
      "job.print_config",
      "job.save_config_file",
      "job.custom_config_module",
      "profiling.profiler_active",
      "profiling.profiler_warmup",
      "metrics.disable_color_printing",
      "metrics.enable_wandb",
      "model.converters",
      "model.print_after_conversion",
      "optimizer.implementation",
      "optimizer.early_step_in_backward",
      "training.enable_cpu_offload",
      "training.dtype",
      "training.gc_freq",
      "training.gc_debug",
      "training.dataloader.num_workers",
      "training.dataloader.persistent_workers",
      "training.dataloader.pin_memory",
      "training.dataloader.prefetch_factor",
      "parallelism.fsdp_reshard_after_forward",
      "parallelism.disable_loss_parallel",
      "parallelism.enable_async_tensor_parallel",
      "parallelism.module_fqns_per_model_part",
      "parallelism.pipeline_parallel_first_stage_less_layers",
      "parallelism.pipeline_parallel_last_stage_less_layers",
      "parallelism.pipeline_parallel_layers_per_stage",
      "parallelism.pipeline_parallel_schedule_csv",
      "parallelism.pipeline_parallel_microbatch_size",
      "parallelism.pipeline_parallel_expert_parallel_overlap",
      "parallelism.expert_tensor_parallel_degree",
      "parallelism.expert_parallel_comm_backend",
      "checkpoint.enable_ft_dataloader_checkpoints",
      "checkpoint.initial_load_in_hf_quantized",
      "checkpoint.load_step",
      "checkpoint.exclude_from_loading",
      "checkpoint.enable_first_step_checkpoint",
      "checkpoint.create_seed_checkpoint",
      "checkpoint.load_only",
      "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
      "activation_checkpoint.early_stop",
      "activation_checkpoint.memory_budget",
      "activation_checkpoint.visualize_memory_budget_pareto",
      "activation_checkpoint.preserve_rng_state",
      "activation_checkpoint.determinism_check",
      "activation_checkpoint.debug",
      "compile.enable",
      "compile.components",
      "compile.backend",
      "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
      "quantize.linear.float8.filter_fqns",
      "quantize.linear.float8.emulate",
      "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
      "quantize.linear.mx.recipe_name",
      "quantize.linear.mx.filter_fqns",
      "quantize.grouped_mm.float8.fqns",
      "quantize.grouped_mm.mx.recipe_name",
      "quantize.grouped_mm.mx.fqns",
      "comm.init_timeout_seconds",
      "comm.train_timeout_seconds",
      "comm.save_traces_file_prefix",
      "comm.mode",
      "memory_estimation.enable",
      "memory_estimation.disable_fake_mode",
      "fault_tolerance.enable",
      "fault_tolerance.process_group",
      "fault_tolerance.process_group_timeout_ms",
      "fault_tolerance.replica_id",
      "fault_tolerance.group_size",
      "fault_tolerance.min_replica_size",
      "fault_tolerance.semi_sync_method",
      "experimental.custom_import",
      "experimental.custom_args_module",
      "validation.dataset",
      "validation.dataset_path",
      "validation.local_batch_size",
      "validation.seq_len",
      "validation.dataloader.num_workers",
      "validation.dataloader.persistent_workers",
      "validation.dataloader.pin_memory",
      "validation.dataloader.prefetch_factor",
      "debug.moe_force_load_balance",
  };
  return keys;
}

// [Note: a job file's defaults] A job file is read as torchtitan reads it, defaults included:
// what it leaves out takes torchtitan's JobConfig default where the flag's differs (the flags'
// defaults are those of the small built-in model; docs/recipe.md gives both). Two are
// conditional: model.flavor "debugmodel" when the file names no model shape at all, and
// local_batch_size 8 when it gives no global_batch_size either (with a global batch and no
// local one, the global batch runs as one microbatch per data-parallel rank: the gradient is
// the same; torchtitan would split it into microbatches of 8 rows). model.attn_mask_type is
// "causal", the default of torchtitan's SDPA flavors (the flag's is documents), and
// context_parallel_load_balancer "headtail" (the flag's is cost).
// activation_checkpoint.mode "selective" (every 2nd block) is in resolve_keys, with the option
// that goes with it.
std::vector<ConfigEntry> torchtitan_file_defaults(const KeyLookup& get) {
  static const std::vector<ConfigEntry> table{
      {"model.attn_mask_type", "--attn-mask", "causal"}, // torchtitan's sdpa flavors'
      {"optimizer.lr", "--lr", "8e-4"},
      {"lr_scheduler.warmup_steps", "--warmup-steps", "200"},
      {"lr_scheduler.decay_ratio", "--decay-ratio", "none"},
      {"training.seq_len", "--seq", "2048"},
      {"training.steps", "--steps", "10000"},
      {"metrics.log_freq", "--log-every", "10"},
      {"parallelism.data_parallel_shard_degree", "--dp-shard", "-1"},
      {"parallelism.context_parallel_load_balancer", "--cp-balance", "headtail"},
  };
  std::vector<ConfigEntry> out;
  for (const ConfigEntry& e : table) {
    if (!get(e.key)) {
      out.push_back(e);
    }
  }
  if (!get("training.global_batch_size") && !get("training.local_batch_size")) {
    out.push_back({"training.local_batch_size", "--local-batch", "8"});
  }
  bool shape = false;
  for (const char* k : {"model.flavor", "model.dim", "model.n_layers", "model.n_heads",
                        "model.n_kv_heads", "model.vocab_size"}) {
    shape = shape || get(k).has_value();
  }
  if (!shape) {
    out.push_back({"model.flavor", "--preset", "debugmodel"});
  }
  return out;
}

std::string flavor_name(const std::string& source, const std::string& model,
                        const std::string& flavor) {
  struct Flavor {
    const char* model;
    const char* flavor;
    const char* preset;
  };
  static const std::vector<Flavor> names{
      {"llama3", "debugmodel", "debugmodel"}, {"llama3", "8B", "llama3-8b"},
      {"llama3", "70B", "llama3-70b"},        {"llama3", "405B", "llama3-405b"},
      {"qwen3", "30B-A3B", "qwen3-30b-a3b"},  {"deepseek_v3", "16B", "deepseek-v3-16b"},
  };
  if (model != "llama3" && model != "qwen3" && model != "deepseek_v3") {
    throw std::invalid_argument((source.empty() ? "" : source + ": ") + "model.name: \"" + model +
                                "\" is not one of llama3, qwen3, deepseek_v3");
  }
  for (const Flavor& f : names) {
    if (model == f.model && flavor == f.flavor) {
      return f.preset;
    }
  }
  return flavor; // this recipe's own name, or --preset's error listing them
}

} // namespace dtensor::train
