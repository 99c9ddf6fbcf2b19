// `train` (the default, `--model llama`): torchtitan's Llama 3 recipe in C++ on the model of
// models/llama3.h. Built on the meta device, parallelized on a (dp_replicate, dp_shard, tp)
// mesh (tensor and sequence parallelism over tp with a vocab-parallel loss, fully_shard over
// the rest: HSDP when dp_replicate > 1), materialized and initialized only in this rank's
// shards; activation checkpointing per block, bf16 parameters with fp32 gradient
// reductions, AdamW and clip_grad_norm_. Each step prints (every --log-every) and writes to
// the metrics file (JSON lines): loss, tokens/s, total gradient norm, collectives, peak
// resident memory. The text is tokenized by a SentencePiece BPE model trained on it at
// start-up (examples/train/tokenizer.h). At the end a greedy sample, decoded through it.
//
//   torchrun --standalone --nproc-per-node 8 --no-python build/examples/train --mesh 2x2x2
//
// Flags: `train --help` (the table in flag_table below). --preset and `--model llama3-8b`
// (main.cpp) choose torchtitan's flavors; --report writes RankReports (dtensor/simulate.h).
// Under a simulated world (DTENSOR_SIMULATE, docs/simulation.md) the same program runs on the
// simulated device: the batch is only a shape, nothing reads values, no checkpoint or sample.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/optimizer.h>

#include <dtensor/all.h>
#include <dtensor/checkpoint.h>
#include <dtensor/device_stats.h>
#include <dtensor/optim_state_dict.h>

#include <models/llama3.h>
#include <models/moe/load_balance.h>

#include "checkpoints.h"
#include "common.h"
#include "flags.h"
#include "llama_flags.h"
#include "model_parts.h"
#include "parallel_dims.h"
#include "recipe_data.h"
#include "recipe_model.h"
#include "metrics.h"
#include "profiling.h"
#include "training_settings.h"

namespace dtensor::train {

namespace {

using models::Llama3;
using models::Llama3Args;

// This rank's model parts (under --pp its stages only), under the whole model's names: the
// checkpoint holds every name some rank saves ([Note: names held by some ranks]), so it is
// the unpipelined recipe's checkpoint and any layout resumes it.
//
// [Note: the loader in the checkpoint] With --data the loader's one number, the sequences
// handed out, is saved under "dataloader.position" (torchtitan's "dataloader" entry): the
// same on every rank, so any mesh resumes at the exact next batch (recipe_data.h).
StateDict train_state(Llama3& model, ModelParts& parts, torch::optim::Optimizer& opt,
                      int64_t step, const RecipeData& data, StateDict* model_part,
                      StateDict* optim_part) {
  *model_part = parts.model_state();
  model_part->erase("freqs_cis"); // recomputed, not trained
  *optim_part = get_optimizer_state_dict(*model, opt);
  StateDict all = *model_part;
  for (const auto& item : *optim_part) {
    all.insert(item.key(), item.value());
  }
  all.insert("step", at::scalar_tensor(step, at::kLong));
  if (data.from_files()) {
    all.insert("dataloader.position", at::scalar_tensor(data.position(), at::kLong));
  }
  return all;
}

int64_t resume(const std::string& dir, Llama3& model, ModelParts& parts,
               torch::optim::Optimizer& opt, RecipeData& data) {
  StateDict m, o;
  StateDict all = train_state(model, parts, opt, 0, data, &m, &o);
  checkpoint::load(all, dir);
  m.insert("freqs_cis", model->freqs_cis);
  parts.load_model_state(m);
  set_optimizer_state_dict(*model, opt, o);
  if (data.from_files()) {
    data.resume(all["dataloader.position"].item<int64_t>());
  }
  return all["step"].item<int64_t>();
}

// The training loop: one batch per data-parallel rank per step (the loader's next, or drawn
// from a per-step seed: a resumed run sees the same data), the loss on vocab-sharded logits
// (LossParallel); every --val-every steps the loss on the held-out batches.
struct Loop {
  const Flags& f;
  const DeviceMesh& dp;
  const at::Device& device;
  Llama3& model;                         // built on meta: its parts run (train/eval mode)
  ModelParts& parts;                     // what this rank runs (model_parts.h)
  const std::vector<at::Tensor>& params; // this rank's (its stages' under --pp)
  torch::optim::Optimizer& opt;
  WarmupStableDecayLR& schedule; // stepped after each optimizer step, as torchtitan's
  RecipeData& data;
  models::ExpertBiasUpdate* bias_update; // MoE models: the load-balancing bias, per step
  std::optional<Group> bias_group;       // the ranks whose expert counts are summed
  const CheckpointFolder& folder;        // --save
  double first = 0, last = 0;
  size_t steps_run = 0; // the steps this process ran (a resumed run: since its start)
  int64_t digest = 0; // this rank's share of the step's global batch digest
  std::optional<checkpoint::AsyncSave> pending; // --async-save
  int64_t flops_per_token = 0; // torchtitan's, for TFLOPs and MFU (llama3_flops_per_token)

  // This rank's index among the data-parallel ranks (row-major over dp_replicate, dp_shard).
  int64_t dp_index() const { return dp.get_local_rank(0) * dp.size(1) + dp.get_local_rank(1); }

  // This rank's rows of the step's global batch (the same global batch on every mesh); with
  // --cp, its positions of them (ModelParts::inputs).
  std::pair<at::Tensor, at::Tensor> batch(int64_t step) {
    if (is_simulated()) { // only the shape matters
      const auto tokens = at::empty({f.batch / dp.size(), parts.local_len()},
                                    at::dtype(at::kLong).device(device));
      return {tokens, tokens};
    }
    const at::Tensor rows = data.train_rows(step);
    digest = data.digest(rows);
    return parts.inputs(rows);
  }

  // The held-out loss, averaged over the validation batches and the data-parallel (and cp)
  // ranks: the whole model's forward in evaluation mode, without gradients, on every layout.
  double validate() {
    double sum = 0;
    model->eval();
    for (int64_t k = 0; k < data.validation_batches(); ++k) {
      auto [x, y] = parts.inputs(data.validation_rows(k), /*whole=*/true);
      at::Tensor loss = parts.evaluate(x, 1, [&y](const at::Tensor& logits) {
        LossParallel vocab_parallel; // the logits stay vocab-sharded ([Note] in loss.cpp)
        at::Tensor l =
            torch::nn::functional::cross_entropy(logits.to(at::kFloat).flatten(0, 1), y.flatten());
        return is_dtensor(l) ? DTensor(l).to_local() : l;
      });
      sum += all_reduce(loss.to(device), ReduceOp::Avg, world_group()).item<double>();
    }
    model->train();
    return sum / static_cast<double>(data.validation_batches());
  }

  // One step of the Trainer, the same on every layout: the step's forwards and backwards
  // (gradient accumulation, the pipeline's schedule: ModelParts), clipping, the optimizer
  // and the learning rate. Returns this rank's loss and the total gradient norm (both as
  // computed). With `recorder`, each phase is recorded (--report).
  std::pair<at::Tensor, at::Tensor> step(int64_t index, StepRecorder* recorder = nullptr) {
    auto phase = [&](const char* name) {
      if (recorder != nullptr) {
        recorder->phase(name);
      }
    };
    auto [x, y] = batch(index);
    opt.zero_grad();
    at::Tensor loss = parts.forward_backward(x, y, phase);
    phase("optimizer");
    at::Tensor norm = parts.clip_grad_norm(f.max_norm);
    optimizer_step();
    parts.after_optimizer_step();
    return {loss, norm};
  }

  // MoE models: the expert counts' all-reduce in flight during the optimizer step, the biases
  // moved after it (torchtitan's pre-step hook, [Note: the bias update off the critical path]).
  void optimizer_step() {
    if (bias_update != nullptr) {
      bias_update->start(bias_group);
    }
    opt.step();
    if (bias_update != nullptr) {
      bias_update->finish();
    }
    schedule.step();
  }

  // The step's loss (ModelParts::mean_loss) and the norm, for the log only (after the step's
  // counted collectives).
  std::pair<double, double> values(const at::Tensor& loss, const at::Tensor& norm) const {
    if (is_simulated()) { // a simulated rank's tensors have no values
      return {std::nan(""), std::nan("")};
    }
    const at::Tensor n = is_dtensor(norm) ? DTensor(norm).to_local() : norm;
    return {parts.mean_loss(loss), n.item<double>()};
  }

  // The step's global batch digest: every rank's share summed over the world, divided by the
  // ranks that load the same rows (cp, tp and pp's): the same on every mesh for the same batch.
  int64_t global_digest() const {
    if (is_simulated()) {
      return 0;
    }
    at::Tensor d = at::full({1}, digest, at::kLong).to(device);
    d = all_reduce(d, ReduceOp::Sum, world_group());
    return d.item<int64_t>() / (get_world_size() / dp.size());
  }

  // The step's metrics beyond the loop's own: the data's digest and position, the held-out
  // loss on the steps it is computed (--val-every, and the last).
  nlohmann::json data_metrics(int64_t s) {
    nlohmann::json j{{"batch_digest", global_digest()}};
    if (f.cp > 1 && !is_simulated()) {
      j["cp_imbalance"] = parts.cp_imbalance(); // rank 0's cp group
    }
    if (data.from_files()) {
      j["data_position"] = data.position();
    }
    if (data.validation_batches() > 0 && ((s + 1) % f.val_every == 0 || s + 1 == f.steps)) {
      j["val_loss"] = validate();
    }
    return j;
  }

  bool run(int64_t start, const std::string& tb_folder) {
    StepLog step_log(f, start, flops_per_token, data.validation_batches(), tb_folder);
    StepProfiler profiler(is_simulated() ? "" : f.profile, is_simulated() ? "" : f.memory_snapshot,
                          f.profile_freq, get_rank(), device, *model);
    step_log.print_header(device_memory_stats(device).available);
    std::vector<double> losses;
    for (int64_t s = start; s < f.steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      const double lr = schedule.current_lrs().front(); // this step's
      std::optional<CommDebugMode> mode(std::in_place);
      std::optional<StepRecorder> recorder;
      if (!f.report.empty() && s + 1 == f.steps) {
        recorder.emplace();
      }
      profiler.begin(s);
      const auto [loss_t, norm_t] = step(s, recorder ? &*recorder : nullptr);
      profiler.end(s);
      if (recorder) {
        RankReport report = recorder->finish(params, &opt);
        report.tokens = f.batch * f.seq;
        write_report(report);
      }
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      StepMetrics m{s,  0,  0, secs, lr, 0, -1, mode->comm_counts(), {}, mode->counts_by_group(),
                    {}, {}};
      for (const auto& [kind, n] : m.counts) {
        m.bytes[kind] = mode->bytes_in(kind);
      }
      mode.reset();
      std::tie(m.loss, m.grad_norm) = values(loss_t, norm_t);
      losses.push_back(m.loss);
      m.extra = data_metrics(s);
      std::tie(m.peak_resident_mib, m.max_live_tensor_mib) = peak_mib();
      m.memory = device_memory_stats(device);
      reset_peak_device_memory(device); // the next step's peaks are its own
      step_log.log(m);
      if (!f.save.empty() && f.save_every > 0 && (s + 1) % f.save_every == 0 && s + 1 < f.steps) {
        save(s + 1);
      }
    }
    if (!f.save.empty()) {
      save_last(f.steps);
    }
    // Mean of the first and last few steps: falling unless training failed. One step (or
    // none) has nothing to compare: the run stands.
    const size_t k = std::min<size_t>(5, std::max<size_t>(1, losses.size() / 4));
    steps_run = losses.size();
    if (losses.empty() || is_simulated()) {
      return true;
    }
    first = std::accumulate(losses.begin(), losses.begin() + k, 0.0) / static_cast<double>(k);
    last = std::accumulate(losses.end() - k, losses.end(), 0.0) / static_cast<double>(k);
    if (losses.size() < 2) {
      return true;
    }
    // A resumed run has learned (below the uniform guess's loss) or is still falling.
    return last < first ||
           (start > 0 && last < std::log(static_cast<double>(data.vocab_size())));
  }

  void write_report(const RankReport& report) const {
    std::filesystem::create_directories(f.report);
    const auto path =
        std::filesystem::path(f.report) / ("rank" + std::to_string(report.rank) + ".json");
    write_output(path.string(), report.to_json() + "\n");
  }

  // The largest rank's peak resident memory and peak of live CPU tensors (MiB; the latter
  // -1 unless counted), in one all-reduce; the tensors' peak reset for the next step.
  std::pair<double, double> peak_mib() const {
    const HostMemoryStats host = host_memory_stats();
    reset_peak_host_memory();
    const double live = host.counting ? static_cast<double>(host.max_live_bytes) / (1 << 20) : -1;
    at::Tensor peak = at::tensor({peak_resident_mib(), live}, at::kDouble);
    if (!is_simulated()) {
      peak = all_reduce(peak.to(device), ReduceOp::Max, world_group()).cpu();
    }
    return {peak[0].item<double>(), peak[1].item<double>()};
  }

  void save(int64_t s) {
    StateDict m, o;
    const auto t0 = std::chrono::steady_clock::now();
    const std::string dir = folder.step_dir(s);
    if (f.async_save) { // waits for the previous save, stages this one, returns
      finish_saves();
      pending = checkpoint::async_save(train_state(model, parts, opt, s, data, &m, &o), dir);
    } else {
      checkpoint::save(train_state(model, parts, opt, s, data, &m, &o), dir);
      folder.prune();
    }
    if (get_rank() == 0) {
      std::printf("%s step %lld to %s in %.2f s\n", f.async_save ? "saving" : "saved",
                  static_cast<long long>(s), dir.c_str(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      std::fflush(stdout);
    }
  }

  // The save at the end: the training state, or the model alone in --export-dtype
  // (torchtitan's last_save_model_only, export_dtype), as a Hugging Face folder with
  // --last-save-hf (last_save_in_hf). Neither is resumed from (latest_checkpoint).
  void save_last(int64_t s) {
    finish_saves();
    if (!f.last_save_model_only && !f.last_save_hf) {
      save(s);
      finish_saves();
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const std::string dir = folder.step_dir(s);
    const c10::ScalarType dtype = export_dtype(f);
    if (f.last_save_hf) {
      parts.export_hf(dir, models::HfExportOptions()
                               .max_shard_bytes(shard_size_bytes(f.export_hf_max_shard))
                               .files(data.hf_files())
                               .dtype(dtype));
    } else {
      StateDict weights;
      for (const auto& item : parts.model_state()) {
        if (item.key() != "freqs_cis") { // recomputed, not trained
          const at::Tensor& v = item.value();
          weights.insert(item.key(), v.is_floating_point() ? v.to(dtype) : v);
        }
      }
      checkpoint::save(weights, dir);
    }
    folder.prune();
    if (get_rank() == 0) {
      std::printf("saved step %lld's model (%s%s) to %s in %.2f s\n", static_cast<long long>(s),
                  f.export_dtype.c_str(), f.last_save_hf ? ", Hugging Face's format" : "",
                  dir.c_str(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      std::fflush(stdout);
    }
  }

  void finish_saves() {
    if (pending) {
      pending->wait();
      pending.reset();
      folder.prune();
    }
  }
};

} // namespace

namespace {

// --prepare DIR: --data's documents tokenized once into DIR ([Note: prepared data] in
// recipe_data.cpp), on one process without a process group; nothing is trained.
// This run's TensorBoard folder (--tensorboard): DIR/<date-time>, rank 0's date and time on
// every rank ("" without --tensorboard or on a simulated world, whose steps have no values).
std::string run_tensorboard_folder(const Flags& f, const at::Device& device) {
  if (f.tensorboard.empty() || is_simulated()) {
    return "";
  }
  at::Tensor stamp = at::full({1}, static_cast<int64_t>(std::time(nullptr)), at::kLong).to(device);
  broadcast_(stamp, 0, world_group());
  return tensorboard_folder(f.tensorboard, stamp.item<int64_t>(), f.tensorboard_all_ranks,
                            get_rank());
}

int prepare_data(const Flags& f) {
  namespace fs = std::filesystem;
  if (f.data.empty() || fs::exists(f.data + ".idx") || fs::exists(f.data + "/train.idx")) {
    usage("--prepare takes --data's document files (text or jsonl), not " +
          (f.data.empty() ? std::string("nothing") : f.data));
  }
  const RecipeData data(f, 0, 1);
  std::printf("prepared %s: train and val (Megatron indexed datasets) and the tokenizer, %lld "
              "ids; train on it with --data %s\n",
              f.prepare.c_str(), static_cast<long long>(data.vocab_size()), f.prepare.c_str());
  return 0;
}

} // namespace

int run_llama(int argc, char** argv) {
  at::set_num_threads(1);
  Flags f = parse(argc, argv);
  if (!f.prepare.empty()) {
    return prepare_data(f);
  }
  if (f.deterministic) {
    use_deterministic_algorithms();
  }
  if (f.flight_recorder_size < -1) {
    usage("--flight-recorder-size " + std::to_string(f.flight_recorder_size) +
          ": a count of collectives, 0 for none");
  }
  FlightRecorderOptions recorder = flight_recorder_options(); // the environment's, then flags'
  if (!f.flight_recorder.empty()) {
    recorder.dump_folder(f.flight_recorder);
  }
  if (f.flight_recorder_size >= 0) {
    recorder.capacity(f.flight_recorder_size);
  }
  set_flight_recorder(recorder);
  std::optional<Muted> muted;
  muted.emplace(STDOUT_FILENO);
  init_process_group();
  const int64_t world = get_world_size();
  const int rank = get_rank();
  resolve_start(f); // [Note: where a run starts]
  const ParallelDims dims = resolve_parallel_dims(f, world); // checked, before any group
  const bool cuda = get_backend() == BackendType::Nccl;
  const at::Device device = default_device(); // the simulated device in a simulated world
  if (device.is_cpu() && !is_simulated()) {
    count_host_memory(); // the live CPU tensors' peak per step ([Note: device figures])
  }
  const DeviceMesh mesh = dims.build_mesh(cuda ? c10::kCUDA : c10::kCPU); // Gloo's lines muted
  const DeviceMesh dp = mesh[{"dp_replicate", "dp_shard"}];
  muted.reset();

  // [Note: the recipe's vocabulary]; this rank's rows: its index among the data-parallel
  // ranks (row-major over dp_replicate, dp_shard).
  RecipeData data(f, dp.get_local_rank(0) * dp.size(1) + dp.get_local_rank(1), dp.size());
  const Llama3Args args = recipe_model_args(f, data.vocab_size());
  Llama3 model{nullptr};
  {
    MetaDeviceGuard meta; // nothing is allocated until to_empty, and then only shards
    model = Llama3(args);
  }
  if (f.float8 != "none") { // torchtitan's converter, before parallelizing (docs/float8.md)
    convert_to_float8_training(*model,
                               Float8LinearOptions()
                                   .recipe(float8_recipe_from_name(f.float8))
                                   .enable_fsdp_float8_all_gather(f.float8_all_gather),
                               float8_skip_output_and_unaligned);
  }
  const int64_t flops_per_token = models::llama3_flops_per_token(model, f.seq); // unsharded
  ModelParts parts(f, dims, mesh, model, device); // parallelized and initialized
  if (f.attn_mask == "documents" && data.from_files()) {
    parts.split_documents(data.eos_id()); // [Note: document masks]
  }
  const std::vector<at::Tensor> params = parts.parameters();
  const std::unique_ptr<torch::optim::Optimizer> optimizer = make_optimizer(f, *model, params);
  torch::optim::Optimizer& opt = *optimizer;
  WarmupStableDecayLR schedule(opt, schedule_options(f));
  int64_t start = 0;
  if (is_simulated() && (!f.save.empty() || !f.resume.empty() || !f.export_hf.empty())) {
    usage("a simulated world has no values to save, resume or export");
  }
  // What is at --save and --export-hf is checked before anything is written or trained.
  const CheckpointFolder folder =
      f.save.empty() ? CheckpointFolder() : CheckpointFolder(f.save, f.keep_latest);
  if (!f.export_hf.empty()) {
    (void)shard_size_bytes(f.export_hf_max_shard);
    on_rank0(
        "--export-hf", [&] { checkpoint::check_target(f.export_hf); }, world_group());
  }
  if (!f.resume.empty()) {
    start = resume(f.resume, model, parts, opt, data);
    schedule.set_steps_taken(start); // the learning rate is a function of the step
    if (rank == 0) {
      std::printf("resumed from %s at step %lld\n", f.resume.c_str(),
                  static_cast<long long>(start));
    }
  }
  // [Note: TFLOPs and MFU] On a GPU without --peak-tflops, the device's datasheet peak, fp8's
  // when the Linears run in float8 (dtensor/device_stats.h).
  if (f.peak_tflops == 0 && cuda) {
    f.peak_tflops = peak_tflops(device_name(device), f.float8 != "none");
  }
  if (rank == 0) {
    std::printf(
        "dtensor train (Llama 3 recipe): %lld ranks as (%s) on %s; vocab %lld, dim %lld, %lld "
        "layers, %lld/%lld heads, batch %lld x "
        "%lld (global%s), %s%s, AC %s, %s, clip %g, seed %lld%s\n",
        static_cast<long long>(world), parts.layout().c_str(),
        is_simulated() ? "the simulated device"
        : cuda         ? device_name(device).c_str()
                       : "cpu",
        static_cast<long long>(args.vocab_size()), static_cast<long long>(args.dim()),
        static_cast<long long>(args.n_layers()), static_cast<long long>(args.n_heads()),
        static_cast<long long>(args.kv_heads()), static_cast<long long>(f.batch),
        static_cast<long long>(f.seq),
        f.accumulation == 1 ? ""
                            : (", " + std::to_string(f.accumulation) + " accumulation steps of " +
                               std::to_string(f.batch / f.accumulation))
                                  .c_str(),
        f.precision == "bf16" ? "bf16 parameters, fp32 reductions" : "fp32",
        f.float8 == "none"
            ? ""
            : (", float8 " + f.float8 + (f.float8_all_gather ? " with float8 all-gather" : ""))
                  .c_str(),
        (f.ac +
         (f.ac_every > 1 && f.ac != "none" ? " on 1 block in " + std::to_string(f.ac_every) : ""))
            .c_str(),
        describe_optimizer(f, schedule.phases()).c_str(), f.max_norm,
        static_cast<long long>(f.seed), f.deterministic ? " (deterministic)" : "");
  }
  // MoE: the load-balancing bias from every rank's counts (sign(mean - count) does not change
  // when ranks that route the same tokens count them twice); under --pp each stage's ranks.
  std::optional<models::ExpertBiasUpdate> bias_update;
  std::optional<Group> bias_group;
  if (args.moe() && args.moe()->load_balance_coeff()) {
    bias_update.emplace(parts.module());
    Muted quiet(STDOUT_FILENO); // Gloo's connection lines, under --pp
    bias_group = parts.part_group();
  }
  Loop loop{f,
            dp,
            device,
            model,
            parts,
            params,
            opt,
            schedule,
            data,
            bias_update ? &*bias_update : nullptr,
            bias_group,
            folder,
            0,
            0,
            0,
            0,
            std::nullopt};
  if (rank == 0) {
    std::printf("data: %s\n", data.describe().c_str());
  }
  loop.flops_per_token = flops_per_token;
  const bool ok = loop.run(start, run_tensorboard_folder(f, device));
  if (is_simulated()) {
    return 0; // nothing to sample or export from tensors without values
  }
  // On a tensor-parallel generator resharded from the trained parts, every layout.
  const std::string text =
      sample(parts, data, data.from_files() ? "The " : "It was the ", 24, device);
  if (!f.export_hf.empty()) {
    parts.export_hf(f.export_hf, models::HfExportOptions()
                                     .max_shard_bytes(shard_size_bytes(f.export_hf_max_shard))
                                     .files(data.hf_files()));
  }
  if (rank == 0) {
    std::printf("sample: \"%s\"\n", text.c_str());
    std::printf("loss %.4f -> %.4f (%s); metrics in %s%s%s\n", loop.first, loop.last,
                !ok                   ? "NOT falling"
                : loop.steps_run < 2 ? "one step: nothing to compare"
                                     : "falling",
                f.metrics.c_str(),
                f.export_hf.empty() ? "" : "; Hugging Face model in ", f.export_hf.c_str());
  }
  return ok ? 0 : 1;
}

} // namespace dtensor::train
