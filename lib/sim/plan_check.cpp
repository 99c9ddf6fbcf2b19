// check_plan: every group's members issue the same collectives ([Note: plan check]).
#include <dtensor/simulate.h>

#include <map>
#include <random>
#include <set>

#include "internal/check.h"

namespace dtensor {

namespace {

// [Note: plan check]
// c10d matches collectives by order within a communicator: the i-th collective a rank issues
// on a group meets the i-th of every other member. A plan is consistent when, for every
// group, all its members issue the same sequence; where one member skips a collective, or
// issues another kind, reduce op, dtype or size, the real job hangs or corrupts data there.
// Each rank's step (a RankReport, real or simulated) gives its sequence per group (keyed by
// the group's global ranks); the sequences of the members that have a report are compared
// position by position. All-to-alls compare kind and dtype only (their splits may differ).

std::string describe(const CollectiveRecord& c) {
  std::string s = to_string(c.kind);
  if (c.kind == CollectiveKind::AllReduce || c.kind == CollectiveKind::ReduceScatter) {
    s += "(" + to_string(c.op) + ")";
  }
  return fmt::format("{} of {} {} ({} bytes in)", s, c10::toString(c.dtype), c.shape, c.bytes_in);
}

bool same(const CollectiveRecord& a, const CollectiveRecord& b) {
  if (a.kind != b.kind || a.dtype != b.dtype) {
    return false;
  }
  if (a.kind == CollectiveKind::AllToAll || a.kind == CollectiveKind::Barrier) {
    return true;
  }
  const bool reduces =
      a.kind == CollectiveKind::AllReduce || a.kind == CollectiveKind::ReduceScatter;
  return (!reduces || a.op == b.op) && a.bytes_in == b.bytes_in && a.bytes_out == b.bytes_out;
}

struct GroupTrace {
  std::string label;
  std::map<int, std::vector<CollectiveRecord>> by_rank; // member -> its sequence
};

std::optional<PlanMismatch> first_mismatch(const std::vector<int>& members, const GroupTrace& g) {
  const size_t longest = [&] {
    size_t n = 0;
    for (const auto& [rank, seq] : g.by_rank) {
      n = std::max(n, seq.size());
    }
    return n;
  }();
  for (size_t i = 0; i < longest; ++i) {
    const auto& [first_rank, first_seq] = *g.by_rank.begin();
    const CollectiveRecord* want = i < first_seq.size() ? &first_seq[i] : nullptr;
    PlanMismatch m{g.label, members, static_cast<int64_t>(i), {}, ""};
    std::string detail;
    for (const auto& [rank, seq] : g.by_rank) {
      const CollectiveRecord* got = i < seq.size() ? &seq[i] : nullptr;
      const bool equal = want && got ? same(*want, *got) : want == got;
      if (!equal) {
        m.ranks.push_back(rank);
        detail += fmt::format("; rank {} issues {}", rank, got ? describe(*got) : "nothing");
      }
    }
    if (!m.ranks.empty()) {
      m.message = fmt::format("group {} (ranks {}): collective #{}: rank {} issues {}{}", g.label,
                              members, i, first_rank, want ? describe(*want) : "nothing", detail);
      return m;
    }
  }
  return std::nullopt;
}

} // namespace

std::vector<PlanMismatch> check_plan(const std::vector<RankReport>& reports) {
  std::map<std::vector<int>, GroupTrace> groups;
  std::map<int, bool> seen;
  for (const auto& r : reports) {
    DTENSOR_CHECK(!seen[r.rank], "check_plan: two reports for rank {}", r.rank);
    seen[r.rank] = true;
    for (const auto& c : r.collectives()) {
      // [Note: point-to-point in the plan check] A send and its receive are issued by
      // different members at different positions (a pipeline stage sends what the next one
      // receives): not a collective that every member issues in the same order. They are left
      // out here; the schedule's own validation pairs them (validate_schedule).
      if (c.kind == CollectiveKind::Send || c.kind == CollectiveKind::Recv) {
        continue;
      }
      GroupTrace& g = groups[c.ranks];
      if (g.label.empty()) {
        g.label = c.group;
      }
      g.by_rank[r.rank].push_back(c);
    }
  }
  // A simulated member that issued nothing on a group still takes part: its empty sequence.
  for (auto& [members, g] : groups) {
    for (int m : members) {
      if (seen.count(m) != 0) {
        g.by_rank[m];
      }
    }
  }
  std::vector<PlanMismatch> found;
  for (const auto& [members, g] : groups) {
    if (auto m = first_mismatch(members, g)) {
      found.push_back(std::move(*m));
    }
  }
  return found;
}

std::vector<int> ranks_to_simulate(const std::vector<int64_t>& mesh_shape, int64_t sample,
                                   uint64_t seed) {
  int64_t world = 1;
  for (int64_t s : mesh_shape) {
    DTENSOR_CHECK(s >= 1, "ranks_to_simulate: mesh shape {} has a dimension below 1", mesh_shape);
    world *= s;
  }
  std::set<int> ranks;
  auto rank_of = [&](const std::vector<int64_t>& coord) {
    int64_t r = 0;
    for (size_t d = 0; d < mesh_shape.size(); ++d) {
      r = r * mesh_shape[d] + coord[d];
    }
    return static_cast<int>(r);
  };
  if (world <= 64) {
    for (int r = 0; r < world; ++r) {
      ranks.insert(r);
    }
  } else {
    for (size_t d = 0; d < mesh_shape.size(); ++d) {
      for (int64_t at : {int64_t{0}, std::min<int64_t>(1, mesh_shape[d] - 1), mesh_shape[d] - 1}) {
        for (bool others_last : {false, true}) {
          std::vector<int64_t> coord(mesh_shape.size());
          for (size_t e = 0; e < mesh_shape.size(); ++e) {
            coord[e] = e == d ? at : others_last ? mesh_shape[e] - 1 : 0;
          }
          ranks.insert(rank_of(coord));
        }
      }
    }
    std::mt19937_64 gen(seed);
    std::uniform_int_distribution<int64_t> pick(0, world - 1);
    for (int64_t i = 0; i < sample; ++i) {
      ranks.insert(static_cast<int>(pick(gen)));
    }
  }
  return {ranks.begin(), ranks.end()};
}

} // namespace dtensor
