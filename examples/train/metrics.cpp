#include "metrics.h"

#include <time.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include <dtensor/collectives.h>
#include <dtensor/process_group.h>

#include "checkpoints.h"

namespace dtensor::train {

namespace {

// "42s", "3m15s", "2h05m": the run's elapsed and remaining time.
std::string duration_text(double s) {
  const auto t = static_cast<int64_t>(std::llround(std::max(0.0, s)));
  char out[32];
  if (t < 60) {
    std::snprintf(out, sizeof out, "%llds", static_cast<long long>(t));
  } else if (t < 3600) {
    std::snprintf(out, sizeof out, "%lldm%02llds", static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  } else {
    std::snprintf(out, sizeof out, "%lldh%02lldm", static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60));
  }
  return out;
}

nlohmann::json by_kind(const std::map<CollectiveKind, int64_t>& m) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [kind, n] : m) {
    j[to_string(kind)] = n;
  }
  return j;
}

} // namespace

// [Note: TensorBoard's tags] torchtitan's names where it logs the same figure, so a team's
// TensorBoard views carry over; the recipe's own figures under names of the same style.
// Each is a key of the metrics line (docs/observability.md lists them with their formulas).
std::vector<std::pair<std::string, double>> tensorboard_scalars(const nlohmann::json& line,
                                                                const std::string& optimizer) {
  static const std::vector<std::pair<const char*, const char*>> tags{
      {"loss", "loss_metrics/global_avg_loss"},
      {"grad_norm", "grad_norm"},
      {"tokens_per_s_per_device", "throughput(tps)"},
      {"tokens_per_s", "throughput_job(tps)"},
      {"tflops_per_device", "tflops"},
      {"mfu_pct", "mfu(%)"},
      {"step_s", "time_metrics/end_to_end(s)"},
      {"tokens_seen", "n_tokens_seen"},
      {"peak_resident_mib", "memory/peak_resident(MiB)"},
      {"max_live_tensor_mib", "memory/max_live_tensors(MiB)"},
      {"memory_max_active_gib", "memory/max_active(GiB)"},
      {"memory_max_active_pct", "memory/max_active(%)"},
      {"memory_max_reserved_gib", "memory/max_reserved(GiB)"},
      {"memory_max_reserved_pct", "memory/max_reserved(%)"},
      {"memory_num_alloc_retries", "memory/num_alloc_retries"},
      {"memory_num_ooms", "memory/num_ooms"},
      {"val_loss", "validation_metrics/loss"},
      {"cp_imbalance", "cp/imbalance"},
  };
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [key, tag] : tags) {
    if (line.contains(key)) {
      out.emplace_back(tag, line[key].get<double>());
    }
  }
  out.emplace_back("lr/" + optimizer, line["lr"].get<double>());
  for (const char* group : {"collectives", "collective_bytes"}) {
    for (const auto& [kind, n] : line[group].items()) {
      out.emplace_back(std::string(group) + "/" + kind, n.get<double>());
    }
  }
  return out;
}

std::string tensorboard_folder(const std::string& dir, int64_t stamp, bool all_ranks, int rank) {
  const time_t t = static_cast<time_t>(stamp);
  struct tm local {};
  localtime_r(&t, &local);
  char name[32];
  std::strftime(name, sizeof name, "%Y%m%d-%H%M%S", &local);
  std::filesystem::path p = std::filesystem::path(dir) / name;
  if (all_ranks) {
    p /= "rank_" + std::to_string(rank);
  }
  return p.string();
}

StepLog::StepLog(const Flags& f, int64_t start, int64_t flops_per_token, int64_t val_batches,
                 const std::string& tb_folder)
    : f_(f), start_(start), flops_per_token_(flops_per_token), val_batches_(val_batches),
      rank_(get_rank()), world_(get_world_size()) {
  metrics_ = open_metrics(f.metrics, start > 0);
  if (tb_folder.empty()) {
    return;
  }
  on_every_rank(
      "--tensorboard",
      [&] {
        if (rank_ == 0 || f.tensorboard_all_ranks) {
          tb_ = std::make_unique<TensorBoardWriter>(tb_folder);
        }
      },
      world_group());
}

void StepLog::print_header(bool device_memory) const {
  // The memory column: the host's peak resident memory, or on a GPU the caching allocator's
  // peak reserved memory during the step.
  if (rank_ == 0) {
    std::printf("%5s %8s %10s %9s %7s %6s %10s %9s %8s %8s  %s\n", "step", "loss", "tokens/s",
                "tok/s/dev", "TFLOPs", "MFU%", "grad norm", device_memory ? "dev GiB" : "peak MiB",
                "elapsed", "left", "collectives (count by kind)");
  }
}

nlohmann::json StepLog::line(const StepMetrics& m) const {
  const double tokens = static_cast<double>(f_.batch * f_.seq) / m.step_s;
  const double per_device = tokens / static_cast<double>(world_);
  nlohmann::json groups = nlohmann::json::object();
  for (const auto& [group, kinds] : m.by_group) {
    groups[group] = by_kind(kinds);
  }
  nlohmann::json line{{"step", m.step},
                      {"loss", m.loss},
                      {"tokens_per_s", tokens},
                      {"tokens_per_s_per_device", per_device},
                      {"tokens_seen", (m.step + 1) * f_.batch * f_.seq},
                      {"grad_norm", m.grad_norm},
                      {"step_s", m.step_s},
                      {"lr", m.lr},
                      {"peak_resident_mib", m.peak_resident_mib},
                      {"collectives", by_kind(m.counts)},
                      {"collective_bytes", by_kind(m.bytes)},
                      {"collectives_by_group", groups}};
  // [Note: TFLOPs and MFU] As torchtitan's: the model's FLOPs per token times the tokens
  // each device processed per second (the job's tokens/s over the ranks), and that against
  // the device's peak (--peak-tflops) in percent.
  const double tflops = static_cast<double>(flops_per_token_) * per_device / 1e12;
  line["flops_per_token"] = flops_per_token_;
  line["tflops_per_device"] = tflops;
  if (f_.peak_tflops > 0) {
    line["mfu_pct"] = 100.0 * tflops / f_.peak_tflops;
  }
  if (m.max_live_tensor_mib >= 0) { // on a CPU, the live tensors' peak during the step
    line["max_live_tensor_mib"] = m.max_live_tensor_mib;
  }
  // On a GPU, the caching allocator's peaks during the step (torchtitan's memory metrics).
  if (m.memory.available) {
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const double capacity = static_cast<double>(m.memory.capacity_bytes);
    line["memory_max_active_gib"] = static_cast<double>(m.memory.max_active_bytes) / gib;
    line["memory_max_active_pct"] =
        100.0 * static_cast<double>(m.memory.max_active_bytes) / capacity;
    line["memory_max_reserved_gib"] = static_cast<double>(m.memory.max_reserved_bytes) / gib;
    line["memory_max_reserved_pct"] =
        100.0 * static_cast<double>(m.memory.max_reserved_bytes) / capacity;
    line["memory_num_alloc_retries"] = m.memory.num_alloc_retries;
    line["memory_num_ooms"] = m.memory.num_ooms;
  }
  line.update(m.extra);
  return line;
}

void StepLog::log(const StepMetrics& m) {
  if (rank_ != 0 && !tb_) {
    return;
  }
  const nlohmann::json l = line(m);
  if (tb_) {
    tb_->add_scalars(m.step, tensorboard_scalars(l, f_.optimizer));
  }
  if (rank_ != 0) {
    return;
  }
  metrics_ << l.dump() << "\n";
  metrics_.flush();
  if (!metrics_.good() && metrics_.is_open()) { // a full disk, say: training goes on
    std::fprintf(stderr, "warning: cannot write the metrics file %s; no more metrics\n",
                 f_.metrics.c_str());
    metrics_.close();
  }
  print_row(m, l);
}

void StepLog::print_row(const StepMetrics& m, const nlohmann::json& l) const {
  const int64_t s = m.step;
  if (s % f_.log_every == 0 || s + 1 == f_.steps) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - began_).count();
    const double left =
        elapsed / static_cast<double>(s + 1 - start_) * static_cast<double>(f_.steps - s - 1);
    std::string counts;
    for (const auto& [kind, n] : m.counts) {
      counts += to_string(kind) + "=" + std::to_string(n) + " ";
    }
    char mfu[16] = "-";
    if (l.contains("mfu_pct")) {
      std::snprintf(mfu, sizeof mfu, "%.1f", l["mfu_pct"].get<double>());
    }
    char memory[16];
    if (l.contains("memory_max_reserved_gib")) {
      std::snprintf(memory, sizeof memory, "%.2f", l["memory_max_reserved_gib"].get<double>());
    } else {
      std::snprintf(memory, sizeof memory, "%.0f", m.peak_resident_mib);
    }
    std::printf("%5lld %8.4f %10.0f %9.0f %7.3g %6s %10.4f %9s %8s %8s  %s\n",
                static_cast<long long>(s), m.loss, l["tokens_per_s"].get<double>(),
                l["tokens_per_s_per_device"].get<double>(), l["tflops_per_device"].get<double>(),
                mfu, m.grad_norm, memory, duration_text(elapsed).c_str(),
                duration_text(left).c_str(), counts.c_str());
  }
  if (m.extra.contains("val_loss")) {
    std::printf("%5lld %8.4f   validation loss (%lld held-out batches)\n",
                static_cast<long long>(s), m.extra["val_loss"].get<double>(),
                static_cast<long long>(val_batches_));
  }
  std::fflush(stdout);
}

} // namespace dtensor::train
