// The layout search: every layout of a world planned in closed form, pruned by memory, ranked
// by tokens/s ([Note: the layout search] in dtensor/layout_planner.h).
#include <dtensor/layout_planner.h>
#include <dtensor/pipeline_schedule.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "internal/check.h"

namespace dtensor {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i) {
    if (n % i == 0) {
      d.push_back(i);
    }
  }
  return d;
}

// The mesh degrees (dp_replicate, dp_shard, tp, pp, cp, ep) of every layout of `world` ranks
// that the model's heads, experts, layers and the job's sequence allow.
std::vector<Layout> meshes(const TransformerShape& m, const JobShape& job, int64_t world,
                           const ClusterSpec& c) {
  std::vector<Layout> out;
  const int64_t kv = m.kv_lora_rank() > 0 ? m.heads() : m.kv_heads();
  for (const int64_t tp : divisors(world)) {
    if (tp > c.gpus_per_node() || m.heads() % tp != 0 || kv % tp != 0) {
      continue;
    }
    for (const int64_t pp : divisors(world / tp)) {
      if (pp > m.layers()) {
        continue;
      }
      for (const int64_t cp : divisors(world / tp / pp)) {
        if (cp > 1 && job.seq() % (2 * cp) != 0) {
          continue;
        }
        const int64_t dp = world / tp / pp / cp;
        for (const int64_t rep : divisors(dp)) {
          const int64_t shard = dp / rep;
          for (const int64_t ep : divisors(shard * cp * tp)) {
            const bool placed =
                (shard * cp) % ep == 0 || (ep % tp == 0 && (shard * cp) % (ep / tp) == 0);
            if (ep > 1 && (m.experts() == 0 || m.experts() % ep != 0 || !placed)) {
              continue;
            }
            out.push_back(Layout().dp_replicate(rep).dp_shard(shard).tp(tp).pp(pp).cp(cp).ep(ep));
          }
        }
      }
    }
  }
  return out;
}

// A mesh's schedules: none without pp; 1F1B and Interleaved1F1B with 2 to 16 stages a rank.
std::vector<std::pair<std::string, int64_t>> schedules(const TransformerShape& m, int64_t pp) {
  if (pp == 1) {
    return {{"", 1}};
  }
  std::vector<std::pair<std::string, int64_t>> s{{"1F1B", 1}};
  for (const int64_t v : {2, 3, 4, 5, 6, 8, 10, 12, 16}) {
    if (pp * v <= m.layers()) {
      s.emplace_back("Interleaved1F1B", v);
    }
  }
  return s;
}

std::vector<std::string> cp_methods(const TransformerShape& m, const Layout& l) {
  if (l.cp() == 1) {
    return {"allgather"};
  }
  std::vector<std::string> methods{"allgather", "ring"};
  if ((m.heads() / l.tp()) % l.cp() == 0) {
    methods.emplace_back("ulysses");
  }
  return methods;
}

// A layout's identity in the ranking: its mesh and schedule (the best checkpointing policy,
// microbatch and context-parallel method stand for it).
using MeshKey =
    std::tuple<int64_t, int64_t, int64_t, int64_t, std::string, int64_t, int64_t, int64_t>;

MeshKey key_of(const Layout& l) {
  return {l.dp_replicate(), l.dp_shard(),       l.tp(), l.pp(),
          l.schedule(),     l.virtual_stages(), l.cp(), l.ep()};
}

// Faster first; where the steps tie (communication hidden alike), the smaller memory.
bool faster(const LayoutPlan& a, const LayoutPlan& b) {
  if (a.time.step != b.time.step) {
    return a.time.step < b.time.step;
  }
  return a.memory.total < b.memory.total;
}

} // namespace

std::vector<LayoutPlan> search_layouts(const TransformerShape& m, const JobShape& job,
                                       int64_t world, const PlannerOptions& options,
                                       int64_t* refused) {
  DTENSOR_CHECK(world >= 1, "search_layouts: world {} must be at least 1", world);
  std::map<MeshKey, LayoutPlan> best;
  int64_t over = 0;
  for (const Layout& mesh : meshes(m, job, world, options.cluster())) {
    const int64_t dp = mesh.dp_replicate() * mesh.dp_shard();
    for (const int64_t mb : {1, 2, 4}) {
      if (job.global_batch() % (dp * mb) != 0) {
        continue;
      }
      const int64_t microbatches = job.global_batch() / dp / mb;
      for (const auto& [schedule, v] : schedules(m, mesh.pp())) {
        if (mesh.pp() > 1 &&
            (microbatches < mesh.pp() || (v > 1 && microbatches % mesh.pp() != 0))) {
          continue; // the schedule cannot take the microbatches
        }
        for (const std::string& method : cp_methods(m, mesh)) {
          for (const CheckpointMode ac :
               {CheckpointMode::None, CheckpointMode::Selective, CheckpointMode::Full}) {
            const Layout l = Layout(mesh)
                                 .microbatch(mb)
                                 .schedule(schedule)
                                 .virtual_stages(v)
                                 .cp_method(method)
                                 .checkpoint(ac);
            LayoutPlan plan = plan_layout(m, job, l, options);
            if (!plan.fits) {
              ++over;
              continue;
            }
            auto [it, fresh] = best.try_emplace(key_of(plan.layout), plan);
            if (!fresh && faster(plan, it->second)) {
              it->second = plan;
            }
          }
        }
      }
    }
  }
  if (refused != nullptr) {
    *refused = over;
  }
  std::vector<LayoutPlan> ranked;
  for (auto& [key, plan] : best) {
    ranked.push_back(std::move(plan));
  }
  std::stable_sort(ranked.begin(), ranked.end(), faster);
  return ranked;
}

} // namespace dtensor
