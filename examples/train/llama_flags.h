#pragma once

// The flags of the Llama 3 recipe (examples/train/llama.cpp, its pipeline part pipeline.cpp):
// the values, their table (`train --help`) and the default mesh.
#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <optional>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <models/llama3.h>

#include "config.h"
#include "flags.h"

namespace dtensor::train {

using cli::FlagTable;

struct Flags {
  std::vector<int64_t> mesh; // empty: from the world size (over the ranks of one cp group)
  // Named degrees instead of --mesh (0: not given; dp_shard -1: the ranks left).
  int64_t dp_replicate = 0, dp_shard = 0, tp = 0;
  std::string config; // --config: the TOML job file the flags were read from first
  int64_t cp = 1;     // context parallelism: the sequence sharded over cp ranks
  std::string cp_method = "allgather";
  std::string cp_balance = "cost";
  std::string attn_mask = "documents"; // packed data: attention inside each document
  int64_t cp_ulysses_degree = 0; // hierarchical: the all-to-all groups' ranks
  int64_t pp = 1; // pipeline parallelism: the blocks cut into stages over pp ranks
  std::string pp_schedule = "1F1B";
  int64_t microbatches = 0; // per step and data-parallel rank (0: 2 x pp)
  int64_t steps = 200, dim = 64, layers = 2, heads = 4, kv_heads = 2, seq = 32, batch = 32;
  // Gradient accumulation (torchtitan's training.local_batch_size): each data-parallel rank's
  // rows of a step in microbatches of local_batch rows (0: one microbatch of all of them);
  // without --batch the step's batch is local_batch x the data-parallel ranks.
  int64_t local_batch = 0;
  bool batch_given = false;
  int64_t accumulation = 1; // the microbatches of a step (resolve_parallel_dims sets it)
  int64_t log_every = 20, save_every = 0, vocab = 128;
  int64_t keep_latest = 10; // torchtitan's keep_latest_k (0: all; 1 is refused)
  double lr = 3e-3, max_norm = 1.0, norm_type = 2.0;
  // The optimizer with torchtitan's defaults, and its learning-rate schedule with those of
  // torchtitan's debug job (warmup 2 steps, the last 80% decaying linearly to 0;
  // lr_scheduler.h). decay_ratio nullopt: the decay starts after the warmup.
  std::string optimizer = "AdamW";
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  // Muon (dtensor/muon.h) for the blocks' matrices, AdamW with the settings above for the rest.
  double muon_momentum = 0.95;
  std::string muon_adjust_lr = "match_rms_adamw";
  int64_t warmup_steps = 2, lr_total_steps = 0; // 0: --steps
  std::optional<double> decay_ratio = 0.8;
  std::string decay_type = "linear";
  double min_lr_factor = 0.0;
  // The seed of the model's initial values and of the data's order; deterministic
  // algorithms only (torch.use_deterministic_algorithms).
  int64_t seed = 0;
  bool deterministic = false;
  std::string ac = "full", precision = "bf16";
  int64_t ac_every = 1; // --ac on every N-th block only (torchtitan's selective_ac_option N)
  double peak_tflops = 0; // a device's peak TFLOPs, for MFU in the metrics (0: no MFU)
  std::string metrics = "train-out/metrics.jsonl";
  std::string tensorboard;            // TensorBoard's event files in DIR/<date-time> (none)
  bool tensorboard_all_ranks = false; // every rank's, in DIR/<date-time>/rank_R
  std::string profile;                // Chrome traces of profiled steps (profiling.h; none)
  int64_t profile_freq = 10;
  std::string memory_snapshot;        // a GPU's memory snapshots at the same steps (none)
  std::string flight_recorder;        // where each rank's flight record goes on a failure
  int64_t flight_recorder_size = -1; // -1: the library's (DTENSOR_FLIGHT_RECORDER_SIZE, 2000)
  std::string export_hf, init_from_hf, save, resume;
  std::string init_from; // a checkpoint's model weights only, at step 0 (a fresh optimizer)
  // The save at the end (torchtitan's last_save_model_only / last_save_in_hf / export_dtype):
  // the model only, in export_dtype; as a Hugging Face folder (the model only).
  bool last_save_model_only = false, last_save_hf = false;
  std::string export_dtype = "float32";
  std::string export_hf_max_shard = "50GB"; // transformers' max_shard_size
  std::string preset, report;  // torchtitan's flavor; the directory of step reports
  bool async_save = false;     // checkpoints written in the background ([Note: asynchronous save])
  bool auto_resume = false;    // continue from --save DIR when it holds a checkpoint
  std::string float8 = "none"; // the Linears' float8 recipe (docs/float8.md)
  bool float8_all_gather = false;
  int64_t ep = 1, experts = 8; // expert parallelism's degree; the small MoE shapes' experts
  // How tokens reach their experts' ranks (docs/moe.md): variable or capacity dispatch, its
  // buffers' factor, and what capacity does with rows past them (refuse or drop).
  std::string ep_dispatch = "variable", ep_overflow = "refuse";
  double ep_capacity_factor = 1.25;
  bool ep_float8_dispatch = false; // the dispatched rows as float8 (D + 4 bytes a row)
  bool ep_overlap = false;          // capacity: two chunks, one's experts while the other travels
  // --data: files of documents (empty: the built-in paragraph), their format, a tokenizer.json
  // (empty: a SentencePiece BPE trained on them); the validation loss every val_every steps
  // over val_steps global batches of the held-out documents (recipe_data.h).
  std::string data, data_format = "text", tokenizer, prepare;
  int64_t val_every = 0, val_steps = 2;
};

// --model / --preset: torchtitan's flavors, and two small MoE shapes (recipe_model.h).
inline const std::vector<std::string>& recipe_flavors() {
  static const std::vector<std::string> names{"debugmodel",  "llama3-8b",     "llama3-70b",
                                              "llama3-405b", "qwen3-30b-a3b", "deepseek-v3-16b",
                                              "qwen3-moe",   "deepseek-v3"};
  return names;
}

inline std::vector<int64_t> parse_mesh(const std::string& s) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t x = s.find('x', start);
    out.push_back(FlagTable::parse_int(s.substr(start, x - start)));
    if (x == std::string::npos) {
      break;
    }
    start = x + 1;
  }
  if (out.size() != 3) {
    throw std::invalid_argument("three sizes: dp_replicate x dp_shard x tp");
  }
  return out;
}

// The recipe's flags: `train --help` prints them.
inline FlagTable flag_table(Flags& f) {
  FlagTable t("train", "examples/train/llama.cpp");
  t.value("--mesh",
          "dp_replicate x dp_shard x tp, e.g. 2x2x2 (default from the world size: "
          "8 -> 2x2x2, 4 -> 1x2x2, 2 -> 1x1x2)",
          [&f](const std::string& v) { f.mesh = parse_mesh(v); })
      .value("--dp-replicate",
             "data-parallel replicas (HSDP's replicate degree; instead of --mesh)", f.dp_replicate)
      .value("--dp-shard", "fully_shard's degree (-1: the ranks left; instead of --mesh)",
             f.dp_shard)
      .value("--tp", "tensor parallelism's degree (instead of --mesh)", f.tp)
      .value("--config",
             "a TOML job file (torchtitan's keys, docs/recipe.md), read before the other flags, "
             "which override it",
             f.config)
      .value("--cp",
             "context parallelism: each sequence sharded over N ranks (1), balanced by "
             "--cp-balance; the world is dp_replicate x dp_shard x cp x tp",
             f.cp)
      .value("--cp-method",
             "how attention reaches the other cp ranks' keys: allgather, ring, ulysses (the "
             "heads, after tp, a multiple of cp), hierarchical (docs/context_parallel.md)",
             f.cp_method, {"allgather", "ring", "ulysses", "hierarchical"})
      .value("--cp-balance",
             "the rows each cp rank holds: cost (chunks of every row dealt by attention cost "
             "under the document mask, documents of any length; without documents head-tail's "
             "order), headtail (chunks r and 2cp-1-r whatever the documents), none (pieces in "
             "order)",
             f.cp_balance, {"cost", "headtail", "none"})
      .value("--cp-ulysses-degree",
             "hierarchical: the cp ranks of each all-to-all group (a node's), a divisor of --cp; "
             "the groups ring",
             f.cp_ulysses_degree)
      .value("--attn-mask",
             "with --data, documents (attention inside each packed document, torchtitan's "
             "block_causal) or causal (over the whole packed row)",
             f.attn_mask, {"documents", "causal"})
      .value("--pp",
             "pipeline parallelism: the blocks cut into stages over N ranks (1); the world is "
             "pp x dp_replicate x dp_shard x tp (docs/pipeline.md)",
             f.pp)
      .value("--pp-schedule", "PyTorch's schedule (1F1B; two stages per rank but for GPipe, 1F1B)",
             f.pp_schedule,
             {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
              "ZBVZeroBubble", "DualPipeV"})
      .value("--microbatches", "microbatches per step of each data-parallel rank (2 x pp)",
             f.microbatches)
      .value("--preset",
             "the model (also --model): llama3-8b|llama3-70b|llama3-405b|qwen3-30b-a3b|"
             "deepseek-v3-16b, or the small MoE shapes qwen3-moe|deepseek-v3 (--dim, --layers)",
             f.preset, recipe_flavors())
      .value("--ep", "expert parallelism's degree over dp_shard x cp x tp (MoE models; 1)", f.ep)
      .value("--experts", "routed experts of the small MoE shapes (8)", f.experts)
      .value("--ep-dispatch",
             "how tokens reach their experts' ranks: variable (the counts read by the host "
             "first, no padding) or capacity (fixed buffers, no host read; docs/moe.md)",
             f.ep_dispatch, {"variable", "capacity"})
      .value("--ep-capacity-factor",
             "capacity: each rank pair's buffer holds this factor x a rank's rows / ep (1.25; "
             ">= ep never overflows)",
             f.ep_capacity_factor)
      .toggle("--ep-float8-dispatch",
              "the rows dispatched to the experts' ranks as float8 with a scale per row (D + 4 "
              "bytes a row; the combine in the activation dtype)",
              f.ep_float8_dispatch)
      .toggle("--ep-overlap",
              "capacity: each experts call in two chunks, one chunk's experts computing while "
              "the other's rows travel, forward and backward (docs/moe.md)",
              f.ep_overlap)
      .value("--ep-overflow",
             "capacity: rows past a buffer stop the step with their counts (refuse) or are "
             "dropped (drop)",
             f.ep_overflow, {"refuse", "drop"})
      .value("--data",
             "documents to train on: files, comma-separated; or a folder --prepare wrote, or a "
             "Megatron indexed dataset's prefix (PREFIX.bin / .idx), memory-mapped (default: "
             "the built-in paragraph)",
             f.data)
      .value("--prepare",
             "tokenize --data's files once into this folder (Megatron indexed datasets "
             "train / val and the tokenizer), then stop: train on it with --data FOLDER",
             f.prepare)
      .value("--data-format",
             "--data's files: text (documents between lines of %, as fortune's) or jsonl "
             "(a \"text\" field per line)",
             f.data_format, {"text", "jsonl"})
      .value("--tokenizer",
             "a Hugging Face tokenizer.json (byte-level BPE) or a SentencePiece .model "
             "(default: a SentencePiece BPE of --vocab pieces trained on --data)",
             f.tokenizer)
      .value("--val-every", "the validation loss every N steps, on every 20th document (0: none)",
             f.val_every)
      .value("--val-steps", "validation batches (--batch each) per evaluation (2)", f.val_steps)
      .value("--steps", "training steps (200)", f.steps)
      .value("--dim", "model width (64)", f.dim)
      .value("--layers", "transformer blocks (2)", f.layers)
      .value("--heads", "attention heads (4)", f.heads)
      .value("--kv-heads", "key/value heads (2)", f.kv_heads)
      .value("--seq", "sequence length (32)", f.seq)
      .value(
          "--batch", "global batch, split over the data-parallel ranks (32)",
          [&f](const std::string& v) {
            f.batch = FlagTable::parse_int(v);
            f.batch_given = true;
          },
          "32")
      .value("--local-batch",
             "rows of one microbatch on each data-parallel rank: gradient accumulation over "
             "--batch / (N x data-parallel ranks) microbatches (0: one microbatch)",
             f.local_batch)
      .value("--vocab", "the tokenizer's pieces (128)", f.vocab)
      .value("--optimizer",
             "the optimizer (torchtitan's names; Muon: the blocks' matrices by Muon, the "
             "embeddings, norms and output by AdamW)",
             f.optimizer, {"AdamW", "Adam", "Muon"})
      .value("--muon-momentum", "Muon's momentum (0.95)", f.muon_momentum)
      .value("--muon-adjust-lr",
             "Muon's learning-rate scaling by matrix shape (match_rms_adamw: the AdamW rate "
             "and weight decay carry over, as Moonlight)",
             f.muon_adjust_lr, {"match_rms_adamw", "original", "spectral_unclamped"})
      .value("--lr", "the optimizer's peak learning rate (3e-3)", f.lr)
      .value("--beta1", "Adam's beta1 (0.9)", f.beta1)
      .value("--beta2", "Adam's beta2 (0.95, torchtitan's)", f.beta2)
      .value("--eps", "Adam's epsilon (1e-8)", f.eps)
      .value("--weight-decay", "decoupled (AdamW) or L2 (Adam) weight decay (0.1)", f.weight_decay)
      .value("--warmup-steps", "linear warmup steps of the learning rate, from lr / N (2)",
             f.warmup_steps)
      .value("--lr-total-steps", "the schedule's length (0: --steps)", f.lr_total_steps)
      .value(
          "--decay-ratio",
          "the share of the steps at the end over which the learning rate decays (0.8; none: "
          "all after the warmup)",
          [&f](const std::string& v) {
            f.decay_ratio = v == "none" || v == "None" ? std::nullopt
                                                       : std::optional(FlagTable::parse_double(v));
          },
          "0.8")
      .value("--decay-type", "the decay's shape", f.decay_type, {"linear", "sqrt", "cosine"})
      .value("--min-lr-factor", "the decay's floor, a fraction of --lr (0)", f.min_lr_factor)
      .value("--seed", "the seed of the model's initial values and the data's order (0)", f.seed)
      .toggle("--deterministic", "deterministic algorithms only (bit-equal reruns)",
              f.deterministic)
      .value("--max-norm", "clip_grad_norm_'s max norm (1.0)", f.max_norm)
      .value("--norm-type", "clip_grad_norm_'s norm type (2.0; any p > 0, or inf)", f.norm_type)
      .value("--ac", "activation checkpointing per block", f.ac, {"full", "selective", "none"})
      .value("--ac-every", "--ac on every N-th block only (layers N-1, 2N-1, ...)", f.ac_every)
      .value("--peak-tflops",
             "a device's peak TFLOPs, for MFU in the metrics (0: a GPU's from its datasheet; "
             "none on the CPU)",
             f.peak_tflops)
      .value("--precision", "parameters in forward and backward", f.precision, {"bf16", "fp32"})
      .value("--float8", "the blocks' Linears in float8 (torchao's recipes; not the output layer)",
             f.float8, {"none", "tensorwise", "rowwise", "rowwise_with_gw_hp"})
      .toggle("--float8-all-gather",
              "fully_shard gathers the float8 weights as float8 (--float8 tensorwise, tp 1), "
              "their scales from one all-reduce after each optimizer step",
              f.float8_all_gather)
      .value("--log-every", "print every N-th step (20)",
             [&f](const std::string& v) {
               f.log_every = std::max<int64_t>(1, FlagTable::parse_int(v));
             })
      .value("--metrics", "JSON lines of every step (train-out/metrics.jsonl)", f.metrics)
      .value("--tensorboard",
             "TensorBoard event files of every step's metrics in DIR/<date-time> (rank 0's)",
             f.tensorboard)
      .toggle("--tensorboard-all-ranks", "every rank's, in DIR/<date-time>/rank_R",
              f.tensorboard_all_ranks)
      .value("--profile",
             "every --profile-freq steps, a Chrome trace of the step per rank: "
             "DIR/iteration_<N>/rank<R>_trace.json (none)",
             f.profile)
      .value("--profile-freq", "the steps between traced ones (10)", f.profile_freq)
      .value("--memory-snapshot",
             "on a GPU, PyTorch's memory snapshot at the --profile-freq steps: "
             "DIR/iteration_<N>/rank<R>_memory_snapshot.pickle (none)",
             f.memory_snapshot)
      .value("--flight-recorder",
             "on a failed collective or a stop, each rank's last collectives as "
             "DIR/rank_<R>.json, for fr_trace (none)",
             f.flight_recorder)
      .value("--flight-recorder-size", "the collectives each rank keeps (2000; 0: none)",
             f.flight_recorder_size)
      .value("--export-hf",
             "a Hugging Face model folder at the end (weights, config.json, tokenizer files)",
             f.export_hf)
      .value("--export-hf-max-shard",
             "its largest weights file, as transformers' max_shard_size: 50GB, 500MB, 2GiB or "
             "bytes (50GB)",
             f.export_hf_max_shard)
      .value("--init-from-hf",
             "start from one (its config.json gives the shape; its tokenizer, when it has one, "
             "tokenizes --data unless --tokenizer is given)",
             f.init_from_hf)
      .value("--init-from",
             "start from a checkpoint's model weights (the newest under a folder; a Hugging "
             "Face folder as --init-from-hf), at step 0 with a fresh optimizer",
             f.init_from)
      .value("--save", "a checkpoint folder: DIR/step-<N> per save, as torchtitan's", f.save)
      .value("--save-every", "steps between checkpoints (0: at the end only)", f.save_every)
      .value("--keep-latest", "keep the K newest checkpoints (10; 0: all; torchtitan's)",
             f.keep_latest)
      .toggle("--last-save-model-only",
              "the save at the end holds the model only (not resumed from; torchtitan's default)",
              f.last_save_model_only)
      .toggle("--last-save-hf",
              "the save at the end as a Hugging Face model folder (the model only)", f.last_save_hf)
      .value("--export-dtype",
             "the model-only last save's dtype: float32, bfloat16, float16 (float32)",
             f.export_dtype)
      .value("--resume", "a checkpoint, or the newest under a checkpoint folder", f.resume)
      .toggle("--async-save", "checkpoints written in the background while training goes on",
              f.async_save)
      .toggle("--auto-resume", "continue from the newest checkpoint under --save DIR",
              f.auto_resume)
      .value("--report", "the last step's RankReport of each rank as DIR/rank<R>.json", f.report);
  return t;
}

[[noreturn]] inline void usage(const std::string& why) {
  Flags f;
  flag_table(f).fail(why);
}

// --export-dtype as a dtype (checked by parse).
inline c10::ScalarType export_dtype(const Flags& f) {
  return f.export_dtype == "bfloat16" ? at::kBFloat16
         : f.export_dtype == "float16" ? at::kHalf
                                       : at::kFloat;
}

// --export-hf-max-shard as bytes: a count, or one with transformers' units (KB, MB, GB: powers
// of 1000; KiB, MiB, GiB: of 1024; any case), as its convert_file_size_to_int reads them.
inline int64_t shard_size_bytes(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) {
    ++digits;
  }
  std::string unit = text.substr(digits);
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const std::map<std::string, int64_t> units = {
      {"", 1},           {"b", 1},           {"kb", 1000},       {"mb", 1000000},
      {"gb", 1000000000}, {"kib", int64_t{1} << 10}, {"mib", int64_t{1} << 20},
      {"gib", int64_t{1} << 30}};
  const auto u = units.find(unit);
  if (digits == 0 || digits > 12 || u == units.end() || std::stoll(text.substr(0, digits)) == 0) {
    usage("--export-hf-max-shard " + text +
          ": not a positive size (bytes, or with KB, MB, GB, KiB, MiB, GiB)");
  }
  return std::stoll(text.substr(0, digits)) * u->second;
}

// `train --help`'s second part: every job-file key by section, with its flag and default.
inline std::string keys_by_section(const FlagTable& table) {
  std::string out = "job-file keys (torchtitan's; also --section.key V on the command line):\n";
  std::string section;
  for (const auto& [key, flag] : config_keys()) {
    const std::string s = key.substr(0, key.find('.'));
    if (s != section) {
      section = s;
      out += "  [" + s + "]\n";
    }
    const std::string shown = flag.empty() ? "" : table.shown_default(flag);
    out += "    " + key.substr(key.find('.') + 1) + (flag.empty() ? "" : "  " + flag) +
           (shown.empty() ? "" : "  (" + shown + ")") + "\n";
  }
  return out;
}

// torchtitan's keys the job gave that this recipe ignores: one warning, on the first rank.
inline void warn_ignored(const JobKeys& keys) {
  const char* rank = std::getenv("RANK");
  if (keys.ignored.empty() || (rank != nullptr && std::string(rank) != "0")) {
    return;
  }
  std::string names;
  for (const std::string& k : keys.ignored) {
    names += (names.empty() ? "" : ", ") + k;
  }
  std::fprintf(stderr,
               "train: warning: %s gives %zu torchtitan key%s this recipe does not implement, "
               "ignored: %s\n",
               keys.source.empty() ? "the command line" : keys.source.c_str(), keys.ignored.size(),
               keys.ignored.size() == 1 ? "" : "s", names.c_str());
}

// [Note: config then flags] --config FILE (torchtitan's --job.config_file) is read first
// wherever it stands, then torchtitan's `--section.key value` overrides, then the flags, so a
// flag overrides a key; an error in the file names the file and the key. torchtitan's keys this
// recipe does not implement are named in one warning (on the first rank), then ignored.
inline Flags parse(int argc, char** argv) {
  Flags f;
  FlagTable table = flag_table(f);
  table.set_epilogue(keys_by_section(table));
  JobKeys keys;
  std::vector<char*> flags{argv[0]};
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const char* next = i + 1 < argc ? argv[i + 1] : nullptr;
      if (a == "--config" || a == "--job.config_file" || a == "--job.config-file") {
        if (next == nullptr) {
          throw std::invalid_argument("flag " + a + " needs a value");
        }
        f.config = next;
        ++i;
      } else if (a.rfind("--job.config_file=", 0) == 0 || a.rfind("--job.config-file=", 0) == 0) {
        f.config = a.substr(a.find('=') + 1);
      } else if (a.rfind("--", 0) == 0 && a.find('.') != std::string::npos &&
                 a.find('.') < a.find('=')) {
        i += add_key_override(keys, a.substr(2), next) - 1;
      } else {
        flags.push_back(argv[i]);
      }
    }
    if (!f.config.empty()) {
      JobKeys file = read_config(f.config);
      file.values.insert(file.values.end(), keys.values.begin(), keys.values.end());
      file.ignored.insert(file.ignored.end(), keys.ignored.begin(), keys.ignored.end());
      keys = std::move(file);
    }
    for (const ConfigEntry& e : resolve_keys(keys)) {
      try {
        table.set(e.flag, e.value);
      } catch (const std::exception& x) {
        throw std::invalid_argument((keys.source.empty() ? "" : keys.source + ": ") + e.key +
                                    ": " + x.what());
      }
    }
  } catch (const std::invalid_argument& e) {
    table.fail(e.what());
  }
  warn_ignored(keys);
  // A --mesh on the command line overrides the file's degrees.
  const std::vector<int64_t> file_mesh = f.mesh;
  const std::array<int64_t, 3> file_degrees{f.dp_replicate, f.dp_shard, f.tp};
  table.parse(static_cast<int>(flags.size()), flags.data());
  if (f.mesh != file_mesh &&
      std::array<int64_t, 3>{f.dp_replicate, f.dp_shard, f.tp} == file_degrees) {
    f.dp_replicate = f.dp_shard = f.tp = 0;
  }
  if (f.ac_every < 1) {
    table.fail("--ac-every (activation_checkpoint.selective_ac_option) " +
               std::to_string(f.ac_every) + ": checkpoint every N-th block, N at least 1");
  }
  if (f.export_dtype != "float32" && f.export_dtype != "bfloat16" && f.export_dtype != "float16") {
    table.fail("--export-dtype (checkpoint.export_dtype) \"" + f.export_dtype +
               "\": float32, bfloat16 or float16, as torchtitan's export_dtype");
  }
  if (f.keep_latest == 1 || f.keep_latest < 0) {
    table.fail("--keep-latest (checkpoint.keep_latest_k) " + std::to_string(f.keep_latest) +
               ": keep 0 (all) or at least 2 (the newest may still be being written), as "
               "torchtitan's keep_latest_k");
  }
  return f;
}

// --dp-replicate / --dp-shard / --tp as the mesh, over `ranks` (the world over cp and pp):
// the missing ones 1, dp_shard -1 or missing the ranks left. An error's text, or "".
inline std::string mesh_from_degrees(Flags& f, int64_t ranks) {
  if (f.dp_replicate == 0 && f.dp_shard == 0 && f.tp == 0) {
    return "";
  }
  if (!f.mesh.empty()) {
    return "give --mesh or the degrees (--dp-replicate, --dp-shard, --tp), not both";
  }
  const int64_t r = f.dp_replicate > 0 ? f.dp_replicate : 1;
  const int64_t t = f.tp > 0 ? f.tp : 1;
  if (f.dp_replicate < 0 || f.tp < 0 || f.dp_shard < -1) {
    return "the degrees must be positive (--dp-shard -1: the ranks left)";
  }
  if (f.dp_shard > 0) {
    f.mesh = {r, f.dp_shard, t};
    return "";
  }
  if (ranks % (r * t) != 0) {
    return "--dp-replicate " + std::to_string(r) + " x --tp " + std::to_string(t) +
           " does not divide the " + std::to_string(ranks) + " ranks left for them";
  }
  f.mesh = {r, ranks / (r * t), t};
  return "";
}

// torchtitan's usual shape for a world size: tp 2 where possible, then dp_shard 2, the rest
// replicated (8 -> 2x2x2, 4 -> 1x2x2, 2 -> 1x1x2, 6 -> 1x3x2).
inline std::vector<int64_t> default_mesh(int64_t world) {
  const int64_t tp = world % 2 == 0 ? 2 : 1;
  const int64_t rest = world / tp;
  const int64_t shard = rest % 2 == 0 ? 2 : rest;
  return {rest / shard, shard, tp};
}

} // namespace dtensor::train
