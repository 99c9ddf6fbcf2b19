// `train --plan N --model NAME --world W [--seq S] [--global-batch B] ...`: the layout search
// (dtensor/layout_planner.h; docs/simulation.md, "Choosing the layout"). Prints the N fastest
// layouts that fit, each with its time and memory by term and the `train --simulate` flags
// that check its plan on sampled ranks; `--find` places a given layout in the ranking.
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>

#include <dtensor/layout_planner.h>
#include <nlohmann/json.hpp>

#include "common.h"
#include "flags.h"

namespace dtensor::train {

using cli::FlagTable;

namespace {

struct PlanFlags {
  int64_t top = 5, world = 0, seq = 8192, global_batch = 0;
  std::string model, shape, find, json;
  bool float8 = false, tp_overlap = false, ep_overlap = false;
  PlannerOptions options;
};

PlanFlags parse_plan(int argc, char** argv) {
  PlanFlags f;
  FlagTable t("train --plan", "examples/train/plan.cpp");
  t.value("--plan", "how many layouts to print (5)", f.top)
      .value("--model",
             "the model's shape: llama3-8b|llama3-70b|llama3-405b|qwen3-30b-a3b|"
             "qwen3-235b-a22b|gpt-oss-120b|deepseek-v3-16b|deepseek-v3",
             f.model)
      .value("--shape",
             "the model's fields by name over --model's (or the defaults'), e.g. "
             "dim=256,layers=4,heads=8,kv_heads=4,head_dim=32,ffn=704,vocab=2048",
             f.shape)
      .value("--world", "GPUs", f.world)
      .value("--seq", "tokens per sequence (8192)", f.seq)
      .value("--global-batch", "sequences per step (the world)", f.global_batch)
      .value("--cluster", "a row of the cluster table: h100|h200|b200|gb200|cpu (h100)",
             [&f](const std::string& v) { f.options.cluster(cluster_spec(v)); })
      .value("--memory-gib", "device memory a layout may use (the row's)",
             [&f](const std::string& v) { f.options.memory_gib(FlagTable::parse_double(v)); })
      .value("--fragmentation", "the allocator's reserve over live bytes (1.1)",
             [&f](const std::string& v) { f.options.fragmentation(FlagTable::parse_double(v)); })
      .value("--efficiency", "fraction of the dense peak the kernels achieve (0.404)",
             [&f](const std::string& v) { f.options.efficiency(FlagTable::parse_double(v)); })
      .value("--attention-efficiency", "attention kernels' fraction of the peak (0.2)",
             [&f](const std::string& v) {
               f.options.attention_efficiency(FlagTable::parse_double(v));
             })
      .toggle("--tp-overlap", "tensor parallelism's collectives under the products", f.tp_overlap)
      .toggle("--ep-overlap", "the experts' all-to-alls under the block's compute", f.ep_overlap)
      .toggle("--float8", "the blocks' products in float8", f.float8)
      .value("--find",
             "a layout to place in the ranking, e.g. tp=4,pp=8,v=5 (dp_rep, dp_shard, "
             "tp, pp, v, cp, ep; dp_shard: the rest; ac, mb, method: plan exactly that)",
             f.find)
      .value("--json", "also write every ranked layout to this file", f.json);
  t.parse(argc, argv);
  if ((f.model.empty() && f.shape.empty()) || f.world < 1) {
    t.fail("--plan needs --model NAME (or --shape) and --world W");
  }
  if (f.global_batch == 0) {
    f.global_batch = f.world;
  }
  f.options.tp_overlap(f.tp_overlap).ep_overlap(f.ep_overlap);
  return f;
}

void need(bool ok, const std::string& why) {
  if (!ok) {
    throw std::invalid_argument("--find: " + why);
  }
}

// --model's shape (the defaults' without it) with --shape's "key=value,..." over it.
TransformerShape parse_shape(const PlanFlags& f) {
  TransformerShape m = f.model.empty() ? TransformerShape() : transformer_shape(f.model);
  if (f.shape.empty()) {
    return m;
  }
  const std::map<std::string, std::function<void(int64_t)>> fields{
      {"dim", [&](int64_t v) { m.dim(v); }},
      {"layers", [&](int64_t v) { m.layers(v); }},
      {"heads", [&](int64_t v) { m.heads(v); }},
      {"kv_heads", [&](int64_t v) { m.kv_heads(v); }},
      {"head_dim", [&](int64_t v) { m.head_dim(v); }},
      {"ffn", [&](int64_t v) { m.ffn_hidden(v); }},
      {"vocab", [&](int64_t v) { m.vocab(v); }},
      {"experts", [&](int64_t v) { m.experts(v); }},
      {"experts_per_token", [&](int64_t v) { m.experts_per_token(v); }},
      {"expert_hidden", [&](int64_t v) { m.expert_hidden(v); }},
      {"shared_experts", [&](int64_t v) { m.shared_experts(v); }},
      {"dense_layers", [&](int64_t v) { m.dense_layers(v); }}};
  std::istringstream in(f.shape);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto eq = item.find('=');
    const auto it = fields.find(item.substr(0, eq));
    if (eq == std::string::npos || it == fields.end()) {
      throw std::invalid_argument("--shape: \"" + item +
                                  "\" is not key=value with a key of dim, layers, heads, "
                                  "kv_heads, head_dim, ffn, vocab, experts, experts_per_token, "
                                  "expert_hidden, shared_experts, dense_layers");
    }
    it->second(FlagTable::parse_int(item.substr(eq + 1)));
  }
  return m.name("custom");
}

// "tp=4,pp=8,v=5" on `world` ranks; dp_shard takes what the others leave. `exact` is set when
// the policy, microbatch or method is given too (ac=, mb=, method=).
Layout parse_layout(const std::string& text, int64_t world, bool& exact) {
  Layout l;
  bool shard_given = false;
  exact = false;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto eq = item.find('=');
    need(eq != std::string::npos, "\"" + item + "\" is not key=value");
    const std::string k = item.substr(0, eq);
    const std::string value = item.substr(eq + 1);
    if (k == "ac" || k == "method") {
      need(k == "method" || value == "none" || value == "selective" || value == "full",
           "ac takes none, selective or full");
      k == "method" ? l.cp_method(value)
                    : l.checkpoint(value == "none"        ? CheckpointMode::None
                                   : value == "selective" ? CheckpointMode::Selective
                                                          : CheckpointMode::Full);
      exact = true;
      continue;
    }
    const int64_t v = FlagTable::parse_int(value);
    if (k == "mb") {
      l.microbatch(v);
      exact = true;
    } else if (k == "dp_rep") {
      l.dp_replicate(v);
    } else if (k == "dp_shard") {
      l.dp_shard(v);
      shard_given = true;
    } else if (k == "tp") {
      l.tp(v);
    } else if (k == "pp") {
      l.pp(v);
    } else if (k == "v") {
      l.virtual_stages(v);
    } else if (k == "cp") {
      l.cp(v);
    } else if (k == "ep") {
      l.ep(v);
    } else {
      need(false,
           "unknown key \"" + k + "\" (dp_rep, dp_shard, tp, pp, v, cp, ep, ac, mb, method)");
    }
  }
  if (!shard_given) {
    const int64_t rest = l.dp_replicate() * l.tp() * l.pp() * l.cp();
    need(world % rest == 0,
         std::to_string(rest) + " ranks do not divide the world " + std::to_string(world));
    l.dp_shard(world / rest);
  }
  need(l.world() == world, "the layout has " + std::to_string(l.world()) + " ranks, the world " +
                               std::to_string(world));
  return l.schedule(l.pp() == 1 ? "" : l.virtual_stages() > 1 ? "Interleaved1F1B" : "1F1B");
}

constexpr double kGiB = 1024.0 * 1024 * 1024;

// The recipe's flags for the model planned: its flavor, or a --shape's dimensions.
std::string recipe_model_flags(const PlanFlags& f) {
  if (f.shape.empty()) {
    return "--model " + f.model;
  }
  const TransformerShape m = parse_shape(f);
  return "--dim " + std::to_string(m.dim()) + " --layers " + std::to_string(m.layers()) +
         " --heads " + std::to_string(m.heads()) + " --kv-heads " + std::to_string(m.kv_heads());
}

void print_plan(const std::string& head, const LayoutPlan& p, const PlanFlags& f,
                const JobShape& job) {
  const TimeTerms& t = p.time;
  const MemoryTerms& m = p.memory;
  std::printf("%s %s: %.0f tok/s/GPU (MFU %.1f%%), step %.2f s\n", head.c_str(),
              to_string(p.layout).c_str(), t.tokens_per_second_per_gpu, 100 * t.mfu, t.step);
  std::printf(
      "    time s: compute %.2f, tp %.2f, cp %.2f, ep %.2f, dp %.2f, pp (bubble, sends) %.2f\n",
      t.compute, t.tp, t.cp, t.ep, t.dp, t.pp);
  std::printf("    memory GiB: parameters %.1f, gradients %.1f, optimizer %.1f, unsharded %.1f, "
              "activations %.1f, logits %.1f, buffers %.1f, x %.2f fragmentation = %.1f%s\n",
              m.parameters / kGiB, m.gradients / kGiB, m.optimizer / kGiB, m.unsharded / kGiB,
              m.activations / kGiB, m.logits / kGiB, m.buffers / kGiB, f.options.fragmentation(),
              m.total / kGiB, p.fits ? "" : (" (" + p.why + ")").c_str());
  std::printf("    check: train %s %s\n", recipe_model_flags(f).c_str(),
              simulate_flags(p.layout, job).c_str());
}

nlohmann::json to_json(const LayoutPlan& p, const JobShape& job) {
  const TimeTerms& t = p.time;
  const MemoryTerms& m = p.memory;
  return {{"layout", to_string(p.layout)},
          {"simulate", simulate_flags(p.layout, job)},
          {"tokens_per_s_per_gpu", t.tokens_per_second_per_gpu},
          {"mfu", t.mfu},
          {"time_s",
           {{"step", t.step},
            {"compute", t.compute},
            {"tp", t.tp},
            {"cp", t.cp},
            {"ep", t.ep},
            {"dp", t.dp},
            {"pp", t.pp}}},
          {"memory_gib",
           {{"total", m.total / kGiB},
            {"parameters", m.parameters / kGiB},
            {"gradients", m.gradients / kGiB},
            {"optimizer", m.optimizer / kGiB},
            {"unsharded", m.unsharded / kGiB},
            {"activations", m.activations / kGiB},
            {"logits", m.logits / kGiB},
            {"buffers", m.buffers / kGiB}}}};
}

// Where `wanted` (its mesh and schedule) ranks, and its plan: the search's best variant, or,
// when none fits or the policy, microbatch or method were given (`exact`), the plan of the
// layout as given.
void find_layout(const std::vector<LayoutPlan>& ranked, const Layout& wanted, bool exact,
                 const TransformerShape& model, const JobShape& job, const PlanFlags& f,
                 nlohmann::json& out) {
  for (size_t i = 0; i < ranked.size() && !exact; ++i) {
    const Layout& l = ranked[i].layout;
    if (l.dp_replicate() == wanted.dp_replicate() && l.dp_shard() == wanted.dp_shard() &&
        l.tp() == wanted.tp() && l.pp() == wanted.pp() && l.cp() == wanted.cp() &&
        l.ep() == wanted.ep() && l.virtual_stages() == wanted.virtual_stages() &&
        l.schedule() == wanted.schedule()) {
      print_plan("the layout asked for ranks #" + std::to_string(i + 1) + " of " +
                     std::to_string(ranked.size()) + ":",
                 ranked[i], f, job);
      out["found"] = to_json(ranked[i], job);
      out["found"]["rank"] = i + 1;
      return;
    }
  }
  const LayoutPlan p = plan_layout(model, job, wanted, f.options);
  out["found"] = to_json(p, job);
  out["found"]["rank"] = nullptr;
  for (size_t i = 0; i < ranked.size(); ++i) { // where its mesh and schedule rank
    const Layout& l = ranked[i].layout;
    if (to_string(Layout(l)
                      .checkpoint(wanted.checkpoint())
                      .microbatch(wanted.microbatch())
                      .cp_method(wanted.cp_method())) == to_string(wanted)) {
      out["found"]["rank"] = i + 1;
      print_plan("the layout asked for (its mesh and schedule rank #" + std::to_string(i + 1) +
                     " of " + std::to_string(ranked.size()) + "):",
                 p, f, job);
      return;
    }
  }
  print_plan("the layout asked for is not ranked:", p, f, job);
}

} // namespace

int run_plan(int argc, char** argv) {
  const PlanFlags f = parse_plan(argc, argv);
  const TransformerShape model = parse_shape(f);
  const JobShape job = JobShape().seq(f.seq).global_batch(f.global_batch).float8(f.float8);
  int64_t refused = 0;
  const std::vector<LayoutPlan> ranked = search_layouts(model, job, f.world, f.options, &refused);
  std::printf("plan: %s (%.4g M parameters) on %lld x %s (%.0f GiB), seq %lld, global batch %lld, "
              "%s\n",
              model.name().c_str(), static_cast<double>(model_parameters(model)) / 1e6,
              static_cast<long long>(f.world), f.options.cluster().name().c_str(),
              f.options.memory_gib() > 0 ? f.options.memory_gib()
                                         : f.options.cluster().memory_gib(),
              static_cast<long long>(f.seq), static_cast<long long>(f.global_batch),
              f.float8 ? "float8 products" : "bf16");
  std::printf("efficiency %.3f (attention %.3f), fragmentation %.2f, tp overlap %s, ep overlap "
              "%s\n",
              f.options.efficiency(),
              f.options.attention_efficiency() > 0 ? f.options.attention_efficiency()
                                                   : f.options.efficiency(),
              f.options.fragmentation(), f.tp_overlap ? "on" : "off", f.ep_overlap ? "on" : "off");
  std::printf("%zu meshes and schedules fit; %lld layouts over memory\n", ranked.size(),
              static_cast<long long>(refused));
  nlohmann::json out = {
      {"model", f.model}, {"world", f.world}, {"ranked", nlohmann::json::array()}};
  for (size_t i = 0; i < ranked.size(); ++i) {
    if (static_cast<int64_t>(i) < f.top) {
      print_plan("#" + std::to_string(i + 1), ranked[i], f, job);
    }
    out["ranked"].push_back(to_json(ranked[i], job));
  }
  if (!f.find.empty()) {
    bool exact = false;
    const Layout wanted = parse_layout(f.find, f.world, exact);
    find_layout(ranked, wanted, exact, model, job, f, out);
  }
  if (!f.json.empty()) {
    std::ofstream file(f.json);
    file << out.dump(1) << "\n";
    if (!file.flush()) {
      throw std::runtime_error("--json: cannot write " + f.json);
    }
  }
  return ranked.empty() ? 1 : 0;
}

} // namespace dtensor::train
