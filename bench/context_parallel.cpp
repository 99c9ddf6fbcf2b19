// One forward and backward of the Llama 3 model over one long sequence, timed: the dtensor
// side of bench/context_parallel.py. Run under torchrun. Three layouts of the same work:
//   --method none (world 1): the plain model on the whole sequence;
//   --method allgather|ring|ulysses|hierarchical: context parallelism over every rank (cp =
//     world), the sequence cut by --balance (headtail, PyTorch's load balancer; documents, by
//     cost; or none), hierarchical's all-to-all groups of --ulysses-degree ranks;
//   --documents 1: one packed row of documents of mixed lengths under the document mask
//     (137, 2041, 89, 1, 1828, 611, 3, ... tokens), with a cp method on 1 rank as its plain
//     model (the block engine: the plain model has no document mask);
//   --method dp: every rank the plain model on a whole sequence of its own (data
//     parallelism's cost per rank, no gradient sync: each rank's job is the 1-rank one).
// The model: --dim, --layers, --heads, --kv-heads, vocabulary 128, fp32, causal attention;
// the loss a cross-entropy over this rank's tokens. No optimizer step (its cost does not
// depend on the layout), gradients set to none before each step.
// Rank 0 prints "RESULT <json>": the median wall time of a step (ms), each rank's CPU time
// per step (user + system of the whole process, Gloo's threads included: what CP's exchanges
// cost the CPU too), each rank's bytes handed to collectives per step (CommDebugMode), the
// K/V bytes the attention calls held at once (cp_stats), and, under LD_PRELOAD of
// bench/live_bytes.cpp, each rank's peak of live tensor bytes over the timed steps; with
// --documents 1 also the documents and every rank's positions (the driver's formula for the
// all-gather method, which then moves only the rows the mask leaves needed).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>

#include "bench_util.h"
#include "flags.h"
#include <dtensor/all.h>
#include <models/llama3.h>

namespace {

using Clock = std::chrono::steady_clock;
using bench::live_bytes_fn;

struct Flags {
  std::string method = "none";
  std::string balance = "headtail";
  int64_t ulysses_degree = 2; // hierarchical's all-to-all groups
  bool documents = false;     // packed documents of mixed lengths, document-masked
  int64_t seq = 1024;
  int64_t dim = 64;
  int64_t layers = 1;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t steps = 3;
  int64_t warmup = 1;
};

Flags parse(int argc, char** argv) {
  Flags f;
  std::string documents = "0";
  dtensor::cli::FlagTable("bench_context_parallel", "bench/context_parallel.cpp")
      .value("--method", "the layout: none (1 rank), dp, or a cp method over every rank", f.method,
             {"none", "dp", "allgather", "ring", "ulysses", "hierarchical"})
      .value("--balance", "how the sequence is cut over the cp ranks (headtail)", f.balance,
             {"headtail", "documents", "none"})
      .value("--ulysses-degree", "ranks in each of hierarchical's all-to-all groups (2)",
             f.ulysses_degree)
      .value("--documents", "1: packed documents of mixed lengths, document-masked (0)", documents,
             {"0", "1"})
      .value("--seq", "sequence length (1024)", f.seq)
      .value("--dim", "model width (64)", f.dim)
      .value("--layers", "transformer blocks (1)", f.layers)
      .value("--heads", "attention heads (4)", f.heads)
      .value("--kv-heads", "key/value heads (2)", f.kv_heads)
      .value("--steps", "timed steps (3)", f.steps)
      .value("--warmup", "untimed steps before them (1)", f.warmup)
      .parse(argc, argv);
  f.documents = documents == "1";
  return f;
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// Packed documents of mixed lengths filling `seq` (lengths cycling through a long, a short
// and a one-token document, as packed data has them; the last one cut to fit).
std::vector<int64_t> mixed_documents(int64_t seq) {
  const std::vector<int64_t> cycle = {137, 2041, 89, 1, 1828, 611, 3};
  std::vector<int64_t> out;
  int64_t left = seq;
  for (size_t i = 0; left > 0; ++i) {
    out.push_back(std::min(left, cycle[i % cycle.size()]));
    left -= out.back();
  }
  return out;
}

dtensor::CpMethod method_of(const std::string& name) {
  return name == "ring"           ? dtensor::CpMethod::Ring
         : name == "ulysses"      ? dtensor::CpMethod::Ulysses
         : name == "hierarchical" ? dtensor::CpMethod::Hierarchical
                                  : dtensor::CpMethod::AllGather;
}

// Every rank's value, gathered (in rank order) as a JSON list.
std::string per_rank(double v, int world) {
  at::Tensor all = at::zeros({world}, at::kDouble);
  all[dtensor::get_rank()] = v;
  dtensor::all_reduce_(all, dtensor::ReduceOp::Sum, dtensor::world_group());
  std::string out;
  for (int r = 0; r < world; ++r) {
    out += (r ? ", " : "") + std::to_string(all[r].item<double>());
  }
  return "[" + out + "]";
}

} // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  at::set_num_threads(1);
  dtensor::init_process_group();
  const int world = dtensor::get_world_size();
  const bool cp = f.method == "allgather" || f.method == "ring" || f.method == "ulysses" ||
                  f.method == "hierarchical";
  auto args = dtensor::models::llama3_tiny_args()
                  .dim(f.dim)
                  .n_layers(f.layers)
                  .n_heads(f.heads)
                  .n_kv_heads(f.kv_heads)
                  .vocab_size(128)
                  .max_seq_len(f.seq);
  torch::manual_seed(0);
  dtensor::models::Llama3 model(args);
  model->init_weights();
  const auto balance = f.balance == "none"        ? dtensor::CpBalance::None
                       : f.balance == "documents" ? dtensor::CpBalance::Documents
                                                  : dtensor::CpBalance::HeadTail;
  // With --documents 1 the document mask: the block engine (a cp method, on 1 rank too).
  std::vector<std::vector<int64_t>> docs;
  if (f.documents) {
    docs.push_back(mixed_documents(f.seq));
  }
  const dtensor::CpLayout layout(f.seq, cp ? world : 1, cp ? balance : dtensor::CpBalance::None,
                                 docs);
  std::optional<dtensor::DeviceMesh> mesh;
  if (cp) {
    mesh = dtensor::init_device_mesh(c10::kCPU, {world}, {"cp"});
    dtensor::ContextParallel style(dtensor::ContextParallelOptions()
                                       .method(method_of(f.method))
                                       .ulysses_degree(f.ulysses_degree));
    dtensor::models::apply_cp(model, *mesh, style);
    style.set_layout(layout);
  }
  // The same sequence on every rank (dp: a sequence of each rank's own).
  at::manual_seed(f.method == "dp" ? 1 + dtensor::get_rank() : 1);
  at::Tensor tokens = at::randint(128, {1, f.seq + 1}, at::kLong);
  at::Tensor x = tokens.narrow(1, 0, f.seq);
  at::Tensor y = tokens.narrow(1, 1, f.seq);
  if (cp) {
    x = dtensor::cp_shard(x, 1, layout, *mesh);
    y = dtensor::cp_shard(y, 1, layout, *mesh);
  }
  auto step = [&] {
    for (auto& p : model->parameters()) {
      p.mutable_grad() = at::Tensor();
    }
    at::Tensor logits = dtensor::call(model, x);
    torch::nn::functional::cross_entropy(logits.flatten(0, 1), y.flatten()).backward();
  };
  for (int i = 0; i < f.warmup; ++i) {
    step();
  }
  if (auto* reset = live_bytes_fn<void()>("live_bytes_reset_peak")) {
    reset();
  }
  dtensor::reset_cp_stats();
  std::vector<double> ms;
  double cpu = 0;
  int64_t bytes = 0;
  for (int i = 0; i < f.steps; ++i) {
    dtensor::barrier(dtensor::world_group());
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    {
      dtensor::CommDebugMode comm;
      step();
      bytes += comm.total_bytes_in();
    }
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    cpu += cpu_seconds() - c0;
  }
  std::sort(ms.begin(), ms.end());
  auto* live_peak = live_bytes_fn<int64_t()>("live_bytes_peak");
  const double live = live_peak != nullptr ? static_cast<double>(live_peak()) / 1e6 : -1.0;
  const double kv = static_cast<double>(dtensor::cp_stats().peak_kv_bytes);
  const std::string cpu_ms = per_rank(cpu * 1e3 / f.steps, world);
  const std::string sent = per_rank(static_cast<double>(bytes) / f.steps, world);
  const std::string kv_bytes = per_rank(kv, world);
  const std::string live_mb = per_rank(live, world);
  at::Tensor wall = at::tensor({ms[ms.size() / 2]}, at::kDouble);
  dtensor::all_reduce_(wall, dtensor::ReduceOp::Max, dtensor::world_group());
  if (dtensor::get_rank() == 0) {
    // Under the document mask the all-gather method moves the rows each rank needs: the
    // documents and every rank's positions let the driver count them from the mask.
    auto list = [](const int64_t* v, int64_t n) {
      std::string out = "[";
      for (int64_t i = 0; i < n; ++i) {
        out += (i > 0 ? ", " : "") + std::to_string(v[i]);
      }
      return out + "]";
    };
    std::string positions = "[";
    for (int64_t r = 0; f.documents && r < layout.cp(); ++r) {
      const at::Tensor pos = layout.positions(r).contiguous();
      positions += (r > 0 ? ", " : "") + list(pos.data_ptr<int64_t>(), pos.numel());
    }
    positions += "]";
    const std::string documents =
        docs.empty() ? "[]" : list(docs[0].data(), static_cast<int64_t>(docs[0].size()));
    std::printf("RESULT {\"step_ms\": %f, \"cpu_ms\": %s, \"bytes_in\": %s, \"peak_kv_bytes\": %s, "
                "\"live_peak_mb\": %s, \"local_len\": %lld, \"documents\": %s, "
                "\"positions\": %s}\n",
                wall.item<double>(), cpu_ms.c_str(), sent.c_str(), kv_bytes.c_str(),
                live_mb.c_str(), static_cast<long long>(layout.local_len()), documents.c_str(),
                positions.c_str());
    std::fflush(stdout);
  }
  return 0;
}
