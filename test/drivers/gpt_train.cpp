// gpt_train: the driver of the fp16 (GradScaler) and compression-hook tests (test/meson.build):
// trains a small GPT-style Transformer (character level, on an embedded text) with tensor
// parallelism on attention and MLP, fully_shard on each block and the root, AdamW and
// clip_grad_norm_, on a (dp, tp) mesh; exits non-zero unless the loss falls. Prints every few
// steps: loss, tokens/s, total gradient norm, and the step's collectives (CommDebugMode); at
// the end a greedy sample of generated text. The main job is examples/train (the Llama 3
// recipe); this smaller recipe serves the tests that drive it.
//
//   torchrun --standalone --nproc-per-node 4 --no-python build/test/gpt_train --dp 2 --tp 2
//
// Flags: `gpt_train --help` (the table in flag_table below).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <dtensor/all.h>
#include <dtensor/checkpoint.h>
#include <dtensor/diagnostics.h>
#include <dtensor/optim_state_dict.h>

#include <models/fsdp_models.h> // common_dtensor's Transformer (also used by the tests)

#include "common.h" // examples/train: the text, muted output, memory figures
#include "flags.h"  // examples/common: the flag table

namespace dtensor::train {

using cli::FlagTable;

namespace {

struct Flags {
  int64_t dp = 0, tp = 0, steps = 300, dim = 64, layers = 2, heads = 4, seq = 32, batch = 8;
  int64_t log_every = 25;
  double lr = 1e-2, max_norm = 1.0, norm_type = 2.0;
  bool fp16 = false;
  bool memory = false;      // --memory: resident memory and cache sizes with each log line
  std::string compress;     // "", "bf16" or "fp16"
  std::string save, resume; // checkpoint directories
  int64_t save_every = 0;   // 0: at the end only
};

Flags parse(int argc, char** argv) {
  Flags f;
  FlagTable("gpt_train", "test/drivers/gpt_train.cpp")
      .value("--dp", "data-parallel degree (default: world / tp)", f.dp)
      .value("--tp", "tensor-parallel degree (default: min(2, world))", f.tp)
      .value("--steps", "training steps (300)", f.steps)
      .value("--dim", "model width (64)", f.dim)
      .value("--layers", "transformer blocks (2)", f.layers)
      .value("--heads", "attention heads (4)", f.heads)
      .value("--seq", "sequence length (32)", f.seq)
      .value("--batch", "batch per data-parallel rank (8)", f.batch)
      .value("--lr", "AdamW's learning rate (1e-2)", f.lr)
      .value("--max-norm", "clip_grad_norm_'s max norm (1.0)", f.max_norm)
      .value("--norm-type", "clip_grad_norm_'s norm type (2; inf)",
             [&f](const std::string& v) {
               f.norm_type = v == "inf" ? INFINITY : FlagTable::parse_double(v);
             })
      .value("--log-every", "print every N-th step (25)", f.log_every)
      .toggle("--memory",
              "every rank's resident memory and cache sizes with each log line "
              "(soak runs: docs/reliability.md)",
              f.memory)
      .toggle("--fp16",
              "fp16 compute: fully_shard mixed precision with fp16 parameters and "
              "reductions, dtensor::GradScaler",
              f.fp16)
      .value("--compress", "gradients reduced through the compression hook (docs/comm_hooks.md)",
             f.compress, {"bf16", "fp16"})
      .value("--save", "a checkpoint of model, optimizer, scaler and step at the end", f.save)
      .value("--save-every", "steps between checkpoints (0: at the end only)", f.save_every)
      .value("--resume", "continue from a checkpoint, on any mesh or number of ranks", f.resume)
      .parse(argc, argv);
  return f;
}

// GPT-2-style initialisation: weights N(0, 0.02), the projections back into the residual
// stream (attention.wo, feed_forward.w2) N(0, 0.02 / sqrt(2 * layers)), biases 0, norms 1.
// The logits start near 0, so the loss starts near ln(vocab).
void gpt_init(torch::nn::Module& model, int64_t layers) {
  c10::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(layers));
  for (auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    at::Tensor& p = item.value();
    const bool norm = name.find("norm") != std::string::npos;
    if (p.dim() < 2) {
      p.fill_(norm && name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0 ? 1.0
                                                                                          : 0.0);
    } else {
      const bool residual = name.find("attention.wo") != std::string::npos ||
                            name.find("feed_forward.w2") != std::string::npos;
      p.normal_(0.0, residual ? residual_std : 0.02);
    }
  }
}

// Greedy continuation of `prompt` (every rank runs the same forward passes).
std::string sample(dtensor::models::Transformer& model, const std::string& prompt, int64_t n,
                   int64_t seq, const std::map<char, int64_t>& index, const at::Device& device) {
  c10::NoGradGuard no_grad;
  std::vector<char> symbol(index.size());
  for (const auto& [c, i] : index) {
    symbol[static_cast<size_t>(i)] = c;
  }
  std::vector<int64_t> ids;
  for (char c : prompt) {
    ids.push_back(index.at(c));
  }
  std::string out = prompt;
  for (int64_t k = 0; k < n; ++k) {
    const auto len = std::min<int64_t>(static_cast<int64_t>(ids.size()), seq);
    std::vector<int64_t> window(ids.end() - len, ids.end());
    at::Tensor x = at::tensor(window, at::kLong).view({1, len}).to(device);
    at::Tensor logits = model->forward(x);
    at::Tensor full = dtensor::is_dtensor(logits) ? dtensor::DTensor(logits).full_tensor() : logits;
    const int64_t next = full[0][len - 1].argmax().item<int64_t>();
    ids.push_back(next);
    out += symbol[static_cast<size_t>(next)];
  }
  return out;
}

// Everything a run continues from: the model's and the optimizer's state dicts (DTensors in
// the current layout), the grad scaler's state and the step, which is also the data position
// (batches are drawn from a per-step seed).
struct TrainState {
  dtensor::StateDict model, optim, all;
};

TrainState train_state(torch::nn::Module& model, torch::optim::Optimizer& opt,
                       const dtensor::GradScaler& scaler, int64_t step) {
  TrainState s;
  s.model = dtensor::get_model_state_dict(model);
  s.optim = dtensor::get_optimizer_state_dict(model, opt);
  s.all = s.model;
  for (const auto& item : s.optim) {
    s.all.insert(item.key(), item.value());
  }
  const dtensor::GradScalerState g = scaler.state_dict();
  s.all.insert("scaler.scale", at::scalar_tensor(g.scale, at::kDouble));
  s.all.insert("scaler.growth_tracker", at::scalar_tensor(g.growth_tracker, at::kLong));
  s.all.insert("step", at::scalar_tensor(step, at::kLong));
  return s;
}

// Loads `dir` into the model, optimizer and scaler; returns the step to continue from.
int64_t resume(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& opt,
               dtensor::GradScaler& scaler) {
  TrainState s = train_state(model, opt, scaler, 0);
  dtensor::checkpoint::load(s.all, dir);
  dtensor::set_model_state_dict(model, s.model);
  dtensor::set_optimizer_state_dict(model, opt, s.optim);
  dtensor::GradScalerState g = scaler.state_dict();
  g.scale = s.all["scaler.scale"].item<double>();
  g.growth_tracker = s.all["scaler.growth_tracker"].item<int64_t>();
  scaler.load_state_dict(g);
  return s.all["step"].item<int64_t>();
}

int run(int argc, char** argv) {
  at::set_num_threads(1);
  Flags f = parse(argc, argv);
  std::optional<Muted> muted;
  muted.emplace(STDOUT_FILENO);
  dtensor::init_process_group();
  const int world = dtensor::get_world_size();
  const int rank = dtensor::get_rank();
  if (f.tp == 0)
    f.tp = world >= 2 ? 2 : 1;
  if (f.dp == 0)
    f.dp = world / f.tp;
  if (f.dp * f.tp != world) {
    std::fprintf(stderr, "train: --dp %lld x --tp %lld != world size %d\n",
                 static_cast<long long>(f.dp), static_cast<long long>(f.tp), world);
    return 2;
  }
  const bool cuda = dtensor::get_backend() == dtensor::BackendType::Nccl;
  const auto device_type = cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  const at::Device device = cuda ? dtensor::default_device() : at::Device(at::kCPU);
  auto mesh = dtensor::init_device_mesh(device_type, {f.dp, f.tp}, {"dp", "tp"});
  auto dp = mesh["dp"];
  auto tp = mesh["tp"];
  dp.get_group(); // make every group now, while Gloo's connection lines are muted
  tp.get_group();
  dtensor::barrier(dtensor::world_group());
  muted.reset();

  // Character vocabulary.
  const std::string text = kCorpus;
  std::set<char> chars(text.begin(), text.end());
  std::map<char, int64_t> index;
  for (char c : chars) {
    index.emplace(c, static_cast<int64_t>(index.size()));
  }
  std::vector<int64_t> ids;
  for (char c : text) {
    ids.push_back(index[c]);
  }
  at::Tensor data = at::tensor(ids, at::kLong);
  const int64_t vocab = static_cast<int64_t>(index.size());

  auto args = dtensor::models::ModelArgs()
                  .vocab_size(vocab)
                  .max_seq_len(f.seq)
                  .dim(f.dim)
                  .n_layers(f.layers)
                  .n_heads(f.heads)
                  .dropout_p(0.0);
  torch::manual_seed(0); // same initial weights everywhere
  dtensor::models::Transformer model(args);
  gpt_init(*model, f.layers);
  model->to(device);
  dtensor::parallelize_module(*model, tp,
                              dtensor::ParallelizePlan{
                                  {"layers.*.attention.w[qkv]", dtensor::ColwiseParallel()},
                                  {"layers.*.attention.wo", dtensor::RowwiseParallel()},
                                  {"layers.*.feed_forward.w1", dtensor::ColwiseParallel()},
                                  {"layers.*.feed_forward.w2", dtensor::RowwiseParallel()},
                              });
  auto fsdp = dtensor::FullyShardOptions().mesh(dp);
  if (f.fp16) {
    fsdp.mp_policy(dtensor::MixedPrecisionPolicy().param_dtype(at::kHalf).reduce_dtype(at::kHalf));
  }
  for (auto& layer : *model->layers) {
    dtensor::fully_shard(*layer, fsdp);
  }
  auto root = dtensor::fully_shard(*model, fsdp);
  if (!f.compress.empty()) {
    root.register_comm_hook({}, f.compress == "bf16" ? dtensor::bf16_compress_hook()
                                                     : dtensor::fp16_compress_hook());
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(0.0));
  dtensor::GradScaler scaler(dtensor::GradScalerOptions().enabled(f.fp16));
  int64_t skipped = 0;
  int64_t start = 0;
  if (!f.resume.empty()) {
    start = resume(f.resume, *model, opt, scaler);
    if (rank == 0) {
      std::printf("resumed from %s at step %lld\n", f.resume.c_str(),
                  static_cast<long long>(start));
    }
  }
  auto save = [&](int64_t step) {
    const auto t0 = std::chrono::steady_clock::now();
    dtensor::checkpoint::save(train_state(*model, opt, scaler, step).all, f.save);
    if (rank == 0) {
      std::printf("saved step %lld to %s in %.2f s\n", static_cast<long long>(step), f.save.c_str(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  };

  if (rank == 0) {
    std::printf(
        "dtensor train: %d ranks as (dp=%lld, tp=%lld) on %s; vocab %lld, dim %lld, %lld layers, "
        "batch %lld x %lld per dp rank, AdamW lr %g, clip max_norm %g norm_type %g%s%s%s\n",
        world, static_cast<long long>(f.dp), static_cast<long long>(f.tp), cuda ? "cuda" : "cpu",
        static_cast<long long>(vocab), static_cast<long long>(f.dim),
        static_cast<long long>(f.layers), static_cast<long long>(f.batch),
        static_cast<long long>(f.seq), f.lr, f.max_norm, f.norm_type,
        f.fp16 ? ", fp16 + GradScaler" : "", f.compress.empty() ? "" : ", compress ",
        f.compress.c_str());
    std::printf("%5s %8s %10s %10s %9s  %s\n", "step", "loss", "tokens/s", "grad norm", "scale",
                "collectives (count by kind)");
  }
  double first = 0, last = 0;
  for (int64_t step = start; step < f.steps; ++step) {
    at::manual_seed(1000 + 31 * step + dp.get_local_rank(0)); // one batch per dp rank
    at::Tensor starts =
        at::randint(static_cast<int64_t>(ids.size()) - f.seq - 1, {f.batch}, at::kLong);
    std::vector<at::Tensor> xs, ys;
    for (int64_t b = 0; b < f.batch; ++b) {
      int64_t s = starts[b].item<int64_t>();
      xs.push_back(data.narrow(0, s, f.seq));
      ys.push_back(data.narrow(0, s + 1, f.seq));
    }
    at::Tensor x = at::stack(xs).to(device);
    at::Tensor y = at::stack(ys).to(device);
    auto t0 = std::chrono::steady_clock::now();
    dtensor::CommDebugMode mode;
    opt.zero_grad();
    at::Tensor logits = model->forward(x);
    at::Tensor full_logits =
        dtensor::is_dtensor(logits) ? dtensor::DTensor(logits).full_tensor() : logits;
    // The loss in fp32 (fp16 logits are upcast first, as usual with mixed precision).
    at::Tensor loss = torch::nn::functional::cross_entropy(
        full_logits.to(at::kFloat).view({-1, vocab}), y.view(-1));
    scaler.scale(loss).backward();
    scaler.unscale_(opt); // clip the true gradients (a no-op when fp16 is off)
    at::Tensor total = root.clip_grad_norm_(f.max_norm, f.norm_type);
    const double scale = scaler.get_scale();
    const bool stepped = scaler.step(opt);
    scaler.update();
    skipped += stepped ? 0 : 1;
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string counts;
    for (const auto& [kind, n] : mode.comm_counts()) {
      counts += dtensor::to_string(kind) + "=" + std::to_string(n) + " ";
    }
    // The loss averaged over the dp ranks, for the log only (not counted above).
    at::Tensor mean_loss = loss.detach().clone();
    dtensor::all_reduce_(mean_loss, dtensor::ReduceOp::Avg, dp.get_group());
    const double l = mean_loss.item<double>();
    if (step == start)
      first = l;
    last = l;
    const bool log = step % f.log_every == 0 || step + 1 == f.steps;
    if (rank == 0 && log) {
      const double norm = dtensor::DTensor(total).to_local().item<double>();
      std::printf("%5lld %8.4f %10.0f %10.4f %9g  %s%s\n", static_cast<long long>(step), l,
                  static_cast<double>(f.batch * f.seq * f.dp) / secs, norm, scale, counts.c_str(),
                  stepped ? "" : " (step skipped: inf/NaN gradients)");
      std::fflush(stdout);
    }
    if (f.memory && log) {
      // Every rank's resident memory, on rank 0 (for soak runs).
      at::Tensor rss = at::full({1}, resident_mib(), at::kDouble).to(device);
      at::Tensor all = dtensor::all_gather_tensor(rss, 0, dtensor::world_group()).cpu();
      const auto caches = dtensor::cache_sizes();
      if (rank == 0) {
        std::string per_rank;
        for (int64_t r = 0; r < all.size(0); ++r) {
          per_rank += " " + std::to_string(static_cast<int>(all[r].item<double>()));
        }
        std::printf("      resident MiB per rank:%s; caches: %zu/%zu decisions, %zu/%zu plans\n",
                    per_rank.c_str(), caches.decisions, caches.decisions_max, caches.plans,
                    caches.plans_max);
        std::fflush(stdout);
      }
    }
    if (!f.save.empty() && f.save_every > 0 && (step + 1) % f.save_every == 0 &&
        step + 1 < f.steps) {
      save(step + 1);
    }
  }
  if (!f.save.empty()) {
    save(f.steps);
  }
  // A resumed run continues a trained model: its loss stays below a uniform guess's, ln(vocab).
  const bool resumed = !f.resume.empty();
  const bool ok = resumed ? last < std::log(static_cast<double>(vocab)) : last < first;
  const std::string text_sample = sample(model, "It was the ", 60, f.seq, index, device);
  if (rank == 0) {
    std::printf("sample: \"%s\"\n", text_sample.c_str());
    std::printf("loss %.4f -> %.4f (%s); %lld skipped steps; final scale %g\n", first, last,
                ok ? (resumed ? "below the untrained model's" : "falling")
                   : (resumed ? "NOT below the untrained model's" : "NOT falling"),
                static_cast<long long>(skipped), scaler.get_scale());
  }
  return ok ? 0 : 1;
}

} // namespace

} // namespace dtensor::train

int main(int argc, char** argv) {
  try {
    return dtensor::train::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_train: error on rank %d: %s\n",
                 dtensor::is_initialized() ? dtensor::get_rank() : -1, e.what());
    return 1;
  }
}
