// The redistribution planner (see [Note: redistribution planning]).
#include <mutex>
#include <unordered_map>

#include <dtensor/diagnostics.h>

#include "internal/check.h"
#include "tensor/dispatch/handler.h"
#include "tensor/placement_helpers.h"
#include "tensor/redistribute/redistribute.h"
#include "tensor/redistribute/transitions.h"

namespace dtensor::detail {

namespace {

// Shape of the piece over mesh dim `i` under `current` placements.
std::vector<int64_t> logical_shape(const DTensorSpec& spec, const Placements& current, size_t i) {
  std::vector<int64_t> shape = spec.shape;
  auto coord = *spec.mesh.get_coordinate();
  for (size_t j = 0; j < i; ++j) {
    if (current[j].is_shard()) {
      auto d = static_cast<size_t>(current[j].dim());
      shape[d] = chunk_size(shape[d], spec.mesh.size(static_cast<int64_t>(j)), coord[j]);
    }
  }
  return shape;
}

// Does mesh dim k change how tensor dim d is cut?
bool changes_dim(const Placement& cur, const Placement& dst, int64_t d) {
  return cur != dst && (cur.is_shard(d) || dst.is_shard(d));
}

struct Key {
  DTensorSpec src;
  Placements dst;
  bool operator==(const Key& o) const { return src == o.src && dst == o.dst; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = k.src.hash();
    for (const auto& p : k.dst) {
      h = h * 31 + p.hash();
    }
    return h;
  }
};

constexpr size_t kMaxCachedPlans = 4096;

struct PlanCache {
  std::mutex mutex;
  std::unordered_map<Key, std::vector<TransformStep>, KeyHash> plans;
};

PlanCache& plan_cache() {
  static PlanCache cache;
  return cache;
}

bool commute(const Placement& a, const Placement& b) {
  auto linear = [](ReduceOp op) { return op == ReduceOp::Sum || op == ReduceOp::Avg; };
  return a.reduce_op() == b.reduce_op() || (linear(a.reduce_op()) && linear(b.reduce_op()));
}

// [Note: partial order] The value of a DTensor Partial on several mesh dims reduces them in
// mesh-dim order (as redistributing to Replicate does). Sum / avg and max / min do not
// commute, so a plan that reduces a later mesh dim while an earlier one stays Partial with
// such another op would change the value: the earlier dim is reduced first (to Replicate)
// and made Partial again at the end. PyTorch refuses these targets (any Partial target).
std::vector<bool> reduce_first(const Placements& src, const Placements& dst) {
  std::vector<bool> out(src.size(), false);
  for (size_t i = 0; i < src.size(); ++i) {
    if (!src[i].is_partial() || !dst[i].is_partial()) {
      continue;
    }
    for (size_t j = i + 1; j < src.size() && !out[i]; ++j) {
      out[i] = src[j].is_partial() && dst[j] != src[j] && !commute(src[i], src[j]);
    }
  }
  return out;
}

std::vector<TransformStep> make_plan(const DTensorSpec& src, const Placements& dst) {
  const size_t n = src.placements.size();
  Placements cur = src.placements;
  std::vector<TransformStep> steps;
  auto add = [&](size_t i, const Placement& to) {
    // Decompose into transitions: each step is one registered transition.
    std::vector<Placement> route = route_through_replicate(cur[i], to, logical_shape(src, cur, i),
                                                          src.mesh.size(static_cast<int64_t>(i)));
    for (const Placement& next : route) {
      TransformStep step;
      step.mesh_dim = static_cast<int64_t>(i);
      step.src = cur[i];
      step.dst = next;
      step.logical_shape = logical_shape(src, cur, i);
      step.group_size = src.mesh.size(static_cast<int64_t>(i));
      step.transition = &find_transition(step);
      step.communicates = step.transition->communicates;
      steps.push_back(std::move(step));
      cur[i] = next;
    }
  };
  const std::vector<bool> deferred = reduce_first(src.placements, dst);
  for (size_t i = 0; i < n; ++i) {
    if (deferred[i]) {
      add(i, Placement::replicate()); // [Note: partial order]
    }
  }
  // 1. Right to left: zero-fill every shard whose target is Partial(sum); gather every other
  //    shard whose mesh dimension leaves Shard for Replicate or another Partial, or to whose
  //    left a mesh dimension changes the cut of the same tensor dim.
  //    (Shard(d) -> Shard(e) stays for an all-to-all in pass 2: anything nested to its right
  //    on d or e has been gathered here already.)
  for (size_t i = n; i-- > 0;) {
    if (!cur[i].is_shard()) {
      continue;
    }
    int64_t d = cur[i].dim();
    // Shard -> Partial(sum) zero-fills in place ([Note: shard to partial by zero-filling],
    // transitions.cpp), here, while the dims to its left still cut d as the shard assumes;
    // what they do later moves the filled tensor like any other.
    if (dst[i].is_partial() && !dst[i].is_norm_partial() && dst[i].reduce_op() == ReduceOp::Sum) {
      add(i, dst[i]);
      continue;
    }
    bool must_gather = cur[i] != dst[i] && !dst[i].is_shard();
    for (size_t k = 0; k < i && !must_gather; ++k) {
      must_gather = changes_dim(cur[k], dst[k], d);
    }
    if (must_gather) {
      add(i, Placement::replicate());
    }
  }
  // 2. Left to right: move every mesh dimension to its target.
  for (size_t i = 0; i < n; ++i) {
    if (cur[i] != dst[i] && !deferred[i]) {
      add(i, dst[i]);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (deferred[i]) {
      add(i, dst[i]);
    }
  }
  return steps;
}

} // namespace

std::string TransformStep::to_string() const {
  return fmt::format("mesh dim {}: {} -> {} [{}] on {}", mesh_dim, src.to_string(), dst.to_string(),
                     transition != nullptr ? transition->name : "?", logical_shape);
}

std::vector<TransformStep> plan_redistribute(const DTensorSpec& src, const Placements& dst) {
  DTENSOR_CHECK(dst.size() == src.placements.size(),
                "redistribute: {} target placements {} for a mesh of {} dimensions ({})", dst.size(),
                to_string(dst), src.placements.size(), src.to_string());
  const Placements target = normalize_placements(dst, src.shape, "redistribute (target)");
  PlanCache& cache = plan_cache();
  Key key{src, target};
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    auto it = cache.plans.find(key);
    if (it != cache.plans.end()) {
      return it->second;
    }
  }
  auto plan = make_plan(src, target);
  std::lock_guard<std::mutex> lock(cache.mutex);
  if (cache.plans.size() >= kMaxCachedPlans) {
    cache.plans.clear(); // bounded: start over rather than grow without limit
  }
  cache.plans.emplace(std::move(key), plan);
  return plan;
}

size_t redistribute_plan_cache_size() {
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return cache.plans.size();
}

size_t redistribute_plan_cache_bound() { return kMaxCachedPlans; }

at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src, const Placements& dst) {
  return execute_redistribute(local, src, plan_redistribute(src, dst));
}

} // namespace dtensor::detail

namespace dtensor {

CacheSizes cache_sizes() {
  CacheSizes s;
  s.decisions = detail::decision_cache_size();
  s.decisions_max = detail::decision_cache_bound();
  s.plans = detail::redistribute_plan_cache_size();
  s.plans_max = detail::redistribute_plan_cache_bound();
  return s;
}

} // namespace dtensor
