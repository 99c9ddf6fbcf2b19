// dtensor's random state and the draws of random ops (see rng_state.h, dtensor/random.h).
#include "tensor/random/rng_state.h"

#include <mutex>

#include <ATen/CPUGeneratorImpl.h>

#include <dtensor/random.h>

#include "internal/check.h"

namespace dtensor {

namespace {

struct State {
  std::mutex mutex;
  RngState value;
};

State& state() {
  static State s;
  return s;
}

} // namespace

void manual_seed(uint64_t seed, const DeviceMesh& mesh) {
  DTENSOR_CHECK(mesh.get_coordinate().has_value(),
                "manual_seed: rank {} is not in {}; every rank that runs DTensor random ops on a "
                "mesh must seed it",
                get_rank(), mesh.to_string());
  std::lock_guard<std::mutex> lock(state().mutex);
  state().value = RngState{true, seed, 0};
}

namespace {

struct BatchSlice {
  int64_t count = 1;
  int64_t index = 0;
};

thread_local BatchSlice batch_slice;

} // namespace

BatchShardGuard::BatchShardGuard(int64_t count, int64_t index)
    : previous_count_(batch_slice.count), previous_index_(batch_slice.index) {
  DTENSOR_CHECK(count >= 1 && index >= 0 && index < count,
                "BatchShardGuard: slice index {} out of range for {} slices", index, count);
  batch_slice = BatchSlice{count, index};
}

BatchShardGuard::BatchShardGuard(const DeviceMesh& dp_mesh)
    : previous_count_(batch_slice.count), previous_index_(batch_slice.index) {
  const auto coordinate = dp_mesh.get_coordinate();
  DTENSOR_CHECK(coordinate.has_value(), "BatchShardGuard: rank {} is not in {}", get_rank(),
                dp_mesh.to_string());
  int64_t index = 0;
  for (int64_t d = 0; d < dp_mesh.ndim(); ++d) {
    index = index * dp_mesh.size(d) + (*coordinate)[static_cast<size_t>(d)];
  }
  batch_slice = BatchSlice{dp_mesh.size(), index};
}

BatchShardGuard::~BatchShardGuard() { batch_slice = BatchSlice{previous_count_, previous_index_}; }

RngState get_rng_state() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().value;
}

void set_rng_state(const RngState& s) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().value = s;
}

} // namespace dtensor

namespace dtensor::detail {

Draw next_draw(const std::optional<at::Generator>& generator, const char* op_name) {
  if (!generator || !generator->defined()) {
    std::lock_guard<std::mutex> lock(state().mutex);
    RngState& s = state().value;
    if (s.seeded) {
      return Draw{s.seed, s.offset++};
    }
  }
  at::Generator gen = generator && generator->defined() ? *generator : at::detail::getDefaultCPUGenerator();
  DTENSOR_CHECK(gen.device().is_cpu(),
                "{}: a DTensor random op takes a CPU generator (it draws the op's offset from "
                "it), got one for {}",
                op_name, gen.device().str());
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return Draw{cpu->current_seed(), cpu->random64()};
}

std::pair<int64_t, int64_t> current_batch_slice() { return {batch_slice.count, batch_slice.index}; }

Box in_global_batch(const Box& box) {
  if (batch_slice.count == 1 || box.global_shape.empty()) {
    return box;
  }
  Box out = box;
  out.offset[0] += batch_slice.index * box.global_shape[0];
  out.global_shape[0] *= batch_slice.count;
  return out;
}

} // namespace dtensor::detail
