#include "profiling.h"

#include <cstdio>
#include <filesystem>
#include <set>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/nn/module.h>

#include <dtensor/device_stats.h>

namespace dtensor::train {

namespace {

namespace prof = torch::profiler::impl;

prof::ProfilerConfig config() {
  return prof::ProfilerConfig(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
}

std::set<prof::ActivityType> activities(bool cuda) {
  std::set<prof::ActivityType> out{prof::ActivityType::CPU};
  if (cuda) {
    out.insert(prof::ActivityType::CUDA);
  }
  return out;
}

} // namespace

StepProfiler::StepProfiler(std::string folder, std::string memory_folder, int64_t freq, int rank,
                           c10::Device device, torch::nn::Module& root)
    : folder_(std::move(folder)), memory_folder_(std::move(memory_folder)), freq_(freq),
      rank_(rank), device_(device) {
  if (!memory_folder_.empty() && !device_.is_cuda()) {
    if (rank_ == 0) {
      std::fprintf(stderr,
                   "warning: --memory-snapshot: the CUDA caching allocator's, on a GPU "
                   "only; none written on %s\n",
                   device_.str().c_str());
    }
    memory_folder_.clear();
  }
  if (!memory_folder_.empty()) {
    record_memory_history(device_, 100000); // torchtitan's number of events
  }
  if (folder_.empty()) {
    return;
  }
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    names_[item.value().get()] = item.key();
  }
  // Around everything else on the call (fully_shard's gathers, checkpointing, layouts),
  // only while this thread's profiler records (autograd's threads inherit it).
  scopes_ = register_global_module_hooks(
      ModuleHooks()
          .name("profiler scopes")
          .order(hook_order::kAttribution - 1)
          .active([this] { return active_ && prof::profilerEnabled(); })
          .around_forward(
              [this](torch::nn::Module& m, const TensorList& inputs, const ForwardFn& forward) {
                const auto it = names_.find(&m);
                const std::string name = "module: " + (it == names_.end() ? m.name() : it->second);
                at::RecordFunction scope(at::RecordScope::USER_SCOPE);
                if (scope.isActive()) {
                  scope.before(name, c10::ArrayRef<const c10::IValue>{});
                }
                return forward(inputs);
              }));
}

StepProfiler::~StepProfiler() {
  scopes_.remove();
  if (active_) {
    torch::autograd::profiler::disableProfiler(); // a step that threw: nothing to save
  }
}

bool StepProfiler::profiled(int64_t step) const {
  return freq_ > 0 && (step + 1) % freq_ == 0;
}

std::filesystem::path StepProfiler::path(const std::string& folder, int64_t step,
                                         const std::string& name) const {
  const std::filesystem::path dir =
      std::filesystem::path(folder) / ("iteration_" + std::to_string(step + 1));
  std::filesystem::create_directories(dir);
  return dir / ("rank" + std::to_string(rank_) + name);
}

void StepProfiler::begin(int64_t step) {
  if (folder_.empty() || !profiled(step)) {
    return;
  }
  torch::autograd::profiler::prepareProfiler(config(), activities(device_.is_cuda()));
  torch::autograd::profiler::enableProfiler(config(), activities(device_.is_cuda()));
  active_ = true;
}

void StepProfiler::end(int64_t step) {
  if (!memory_folder_.empty() && profiled(step)) {
    std::string where = memory_folder_;
    try {
      where = path(memory_folder_, step, "_memory_snapshot.pickle").string();
      dump_memory_snapshot(device_, where);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "warning: cannot write the memory snapshot %s: %s\n", where.c_str(),
                   e.what());
    }
  }
  if (!active_) {
    return;
  }
  active_ = false;
  const std::unique_ptr<torch::autograd::profiler::ProfilerResult> result =
      torch::autograd::profiler::disableProfiler();
  std::string where = folder_;
  try {
    where = path(folder_, step, "_trace.json").string();
    result->save(where);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "warning: cannot write the trace %s: %s\n", where.c_str(), e.what());
  }
}

} // namespace dtensor::train
