// StepRecorder: one rank's step by phase (dtensor/simulate.h), and its JSON form.
#include <dtensor/simulate.h>

#include <atomic>
#include <optional>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <dtensor/dtensor.h>
#include <dtensor/fully_shard.h>
#include <dtensor/process_group.h>

#include "internal/check.h"
#include "sim/flop_counter.h"

namespace dtensor {

namespace {

int64_t local_bytes(const at::Tensor& t) {
  if (!t.defined()) {
    return 0;
  }
  return static_cast<int64_t>((is_dtensor(t) ? DTensor(t).to_local() : t).nbytes());
}

// The state tensors of the optimizers LibTorch ships that dtensor's state dicts know.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt) {
  int64_t n = 0;
  for (const auto& [key, state] : opt.state()) {
    if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      n += local_bytes(s->exp_avg()) + local_bytes(s->exp_avg_sq()) +
           local_bytes(s->max_exp_avg_sq());
    } else if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(state.get())) {
      n += local_bytes(a->exp_avg()) + local_bytes(a->exp_avg_sq()) +
           local_bytes(a->max_exp_avg_sq());
    } else if (const auto* g = dynamic_cast<const torch::optim::SGDParamState*>(state.get())) {
      n += local_bytes(g->momentum_buffer());
    }
  }
  return n;
}

} // namespace

struct StepRecorder::State {
  RankReport report;
  std::optional<PhaseReport> current;
  std::unique_ptr<CommDebugMode> mode;
  uint64_t callback = 0;
  bool finished = false;

  void end_phase() {
    if (!current) {
      return;
    }
    current->collectives = mode->records();
    const detail::CountedFlops counted = detail::take_flops();
    current->flops = counted.flops;
    current->work_flops = counted.work;
    current->peak_bytes = simulated_memory_stats().peak_bytes;
    report.peak_bytes = std::max(report.peak_bytes, current->peak_bytes);
    mode.reset();
    report.phases.push_back(std::move(*current));
    current.reset();
  }
};

StepRecorder::StepRecorder() : state_(std::make_unique<State>()) {
  RankReport& r = state_->report;
  r.rank = get_rank();
  r.world_size = get_world_size();
  r.simulated = is_simulated();
  reset_fsdp_peak_memory();
  reset_simulated_peak_memory();
  r.start_bytes = simulated_memory_stats().live_bytes;
  state_->callback = detail::start_counting_flops();
}

StepRecorder::~StepRecorder() {
  if (state_->callback != 0) {
    detail::stop_counting_flops(state_->callback);
  }
}

void StepRecorder::phase(const std::string& name) {
  DTENSOR_CHECK(!state_->finished, "StepRecorder::phase('{}'): the step is finished", name);
  state_->end_phase();
  reset_simulated_peak_memory();
  detail::take_flops();
  state_->current = PhaseReport{name, {}, 0, 0};
  state_->mode = std::make_unique<CommDebugMode>();
}

RankReport StepRecorder::finish(const std::vector<at::Tensor>& params,
                                const torch::optim::Optimizer* optimizer) {
  DTENSOR_CHECK(!state_->finished, "StepRecorder::finish: called twice");
  state_->end_phase();
  state_->finished = true;
  detail::stop_counting_flops(state_->callback);
  state_->callback = 0;
  RankReport& r = state_->report;
  for (const auto& p : params) {
    r.parameter_bytes += local_bytes(p);
    r.gradient_bytes += local_bytes(p.grad());
  }
  r.optimizer_bytes = optimizer != nullptr ? optimizer_state_bytes(*optimizer) : 0;
  r.fsdp_peak_bytes = fsdp_memory_stats().peak_bytes;
  return r;
}

std::vector<CollectiveRecord> RankReport::collectives() const {
  std::vector<CollectiveRecord> all;
  for (const auto& p : phases) {
    all.insert(all.end(), p.collectives.begin(), p.collectives.end());
  }
  return all;
}

int64_t RankReport::flops() const {
  int64_t n = 0;
  for (const auto& p : phases) {
    n += p.flops;
  }
  return n;
}

namespace {

const std::vector<std::pair<CollectiveKind, std::string>>& kind_names() {
  static const std::vector<std::pair<CollectiveKind, std::string>> names = [] {
    std::vector<std::pair<CollectiveKind, std::string>> v;
    for (auto k :
         {CollectiveKind::AllReduce, CollectiveKind::AllGather, CollectiveKind::ReduceScatter,
          CollectiveKind::AllToAll, CollectiveKind::Broadcast, CollectiveKind::Barrier,
          CollectiveKind::Send, CollectiveKind::Recv}) {
      v.emplace_back(k, to_string(k));
    }
    return v;
  }();
  return names;
}

template <typename T>
T parse_name(const std::vector<std::pair<T, std::string>>& names, const std::string& s,
             const char* what) {
  for (const auto& [value, name] : names) {
    if (name == s) {
      return value;
    }
  }
  DTENSOR_FAIL("RankReport::from_json: unknown {} '{}'", what, s);
}

const std::vector<std::pair<ReduceOp, std::string>>& op_names() {
  static const std::vector<std::pair<ReduceOp, std::string>> names = [] {
    std::vector<std::pair<ReduceOp, std::string>> v;
    for (auto op :
         {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product}) {
      v.emplace_back(op, to_string(op));
    }
    return v;
  }();
  return names;
}

nlohmann::json record_json(const CollectiveRecord& c) {
  return {{"kind", to_string(c.kind)},
          {"group", c.group},
          {"ranks", c.ranks},
          {"op", to_string(c.op)},
          {"dtype", c10::toString(c.dtype)},
          {"shape", c.shape},
          {"bytes_in", c.bytes_in},
          {"bytes_out", c.bytes_out},
          {"async", c.async},
          {"issued_at", c.issued_at},
          {"waited_at", c.waited_at}};
}

CollectiveRecord record_from(const nlohmann::json& j) {
  CollectiveRecord c;
  c.kind = parse_name(kind_names(), j.at("kind").get<std::string>(), "collective kind");
  c.group = j.at("group").get<std::string>();
  c.ranks = j.at("ranks").get<std::vector<int>>();
  c.op = parse_name(op_names(), j.at("op").get<std::string>(), "reduce op");
  const auto dtype = j.at("dtype").get<std::string>();
  c.dtype = c10::ScalarType::Undefined;
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    const auto t = static_cast<c10::ScalarType>(i);
    if (dtype == c10::toString(t)) {
      c.dtype = t;
    }
  }
  c.shape = j.at("shape").get<std::vector<int64_t>>();
  c.bytes_in = j.at("bytes_in").get<int64_t>();
  c.bytes_out = j.at("bytes_out").get<int64_t>();
  c.async = j.at("async").get<bool>();
  c.issued_at = j.value("issued_at", int64_t{0});
  c.waited_at = j.value("waited_at", int64_t{-1});
  return c;
}

} // namespace

std::string RankReport::to_json() const {
  nlohmann::json ps = nlohmann::json::array();
  for (const auto& p : phases) {
    nlohmann::json cs = nlohmann::json::array();
    for (const auto& c : p.collectives) {
      cs.push_back(record_json(c));
    }
    ps.push_back({{"name", p.name},
                  {"flops", p.flops},
                  {"work_flops", p.work_flops},
                  {"peak_bytes", p.peak_bytes},
                  {"collectives", std::move(cs)}});
  }
  return nlohmann::json{{"rank", rank},
                        {"world_size", world_size},
                        {"simulated", simulated},
                        {"parameter_bytes", parameter_bytes},
                        {"gradient_bytes", gradient_bytes},
                        {"optimizer_bytes", optimizer_bytes},
                        {"fsdp_peak_bytes", fsdp_peak_bytes},
                        {"start_bytes", start_bytes},
                        {"peak_bytes", peak_bytes},
                        {"tokens", tokens},
                        {"phases", std::move(ps)}}
      .dump();
}

RankReport RankReport::from_json(const std::string& text) {
  try {
    const auto j = nlohmann::json::parse(text);
    RankReport r;
    r.rank = j.at("rank").get<int>();
    r.world_size = j.at("world_size").get<int>();
    r.simulated = j.at("simulated").get<bool>();
    r.parameter_bytes = j.at("parameter_bytes").get<int64_t>();
    r.gradient_bytes = j.at("gradient_bytes").get<int64_t>();
    r.optimizer_bytes = j.at("optimizer_bytes").get<int64_t>();
    r.fsdp_peak_bytes = j.at("fsdp_peak_bytes").get<int64_t>();
    r.start_bytes = j.at("start_bytes").get<int64_t>();
    r.peak_bytes = j.at("peak_bytes").get<int64_t>();
    r.tokens = j.value("tokens", int64_t{0});
    for (const auto& p : j.at("phases")) {
      PhaseReport phase{p.at("name").get<std::string>(),
                        {},
                        p.at("flops").get<int64_t>(),
                        p.at("peak_bytes").get<int64_t>()};
      phase.work_flops = p.value("work_flops", phase.flops); // reports written before it: flops
      for (const auto& c : p.at("collectives")) {
        phase.collectives.push_back(record_from(c));
      }
      r.phases.push_back(std::move(phase));
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    DTENSOR_FAIL("RankReport::from_json: not a rank report: {}", e.what());
  }
}

} // namespace dtensor
