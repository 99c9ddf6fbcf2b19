// `fr_trace DIR`: reads every rank's flight record (DIR/rank_<R>.json, written by dtensor's
// flight recorder when a collective failed or the process was stopped: [Note: the flight
// recorder] in dtensor/flight_recorder.h) and names, for each communicator, the first
// collective where the ranks diverge: the ranks that never issued it, or the ranks that
// issued another collective at that place. Exit status 0 when it read the records (whatever
// they say), 2 when it could not.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Communicator {
  std::vector<int> ranks;
  // Per rank: its collectives on this communicator by sequence number (point-to-point
  // transfers are left out: the two ends differ by nature).
  std::map<int, std::map<int64_t, json>> by_rank;
};

// What must agree across ranks at one place: the operation's name, or the name of the one
// an agreement on sizes was for.
std::string kind_of(const json& e) {
  const std::string agreeing = e["agreeing_on"].get<std::string>();
  return agreeing.empty() ? e["op"].get<std::string>()
                          : "agreement for " + agreeing.substr(0, agreeing.find('('));
}

std::string text_of(const json& e) {
  const std::string agreeing = e["agreeing_on"].get<std::string>();
  std::string out = agreeing.empty() ? e["description"].get<std::string>()
                                     : "the agreement on sizes for " + agreeing;
  return out + " (" + e["state"].get<std::string>() + ")";
}

std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}

// The first place where the ranks of `c` diverge, as a sentence; nullopt when they agree.
std::optional<std::string> first_divergence(const Communicator& c, const std::set<int>& have) {
  std::vector<int> members;
  for (int r : c.ranks) {
    if (have.count(r) != 0) {
      members.push_back(r);
    }
  }
  int64_t lo = 0, hi = -1;
  for (int r : members) {
    const auto it = c.by_rank.find(r);
    if (it != c.by_rank.end() && !it->second.empty()) {
      lo = std::max(lo, it->second.begin()->first); // the oldest place every record holds
      hi = std::max(hi, it->second.rbegin()->first);
    }
  }
  for (int64_t k = lo; k <= hi; ++k) {
    std::map<std::string, std::vector<int>> kinds;
    std::map<std::string, std::string> texts;
    std::vector<int> lacking;
    for (int r : members) {
      const auto it = c.by_rank.find(r);
      const json* e = nullptr;
      if (it != c.by_rank.end()) {
        const auto at = it->second.find(k);
        e = at == it->second.end() ? nullptr : &at->second;
      }
      if (e == nullptr) {
        lacking.push_back(r);
        continue;
      }
      kinds[kind_of(*e)].push_back(r);
      texts.emplace(kind_of(*e), text_of(*e));
    }
    if (lacking.empty() && kinds.size() == 1) {
      continue;
    }
    std::string out = fmt::format("collective #{}: ", k);
    if (!lacking.empty()) {
      std::vector<std::string> lasts;
      for (int r : lacking) {
        const auto it = c.by_rank.find(r);
        lasts.push_back(it == c.by_rank.end() || it->second.empty()
                            ? fmt::format("rank {}: none", r)
                            : fmt::format("rank {}: #{}, {}", r, it->second.rbegin()->first,
                                          text_of(it->second.rbegin()->second)));
      }
      out += fmt::format("{} never issued it (last on this group: {})", rank_list(lacking),
                         fmt::join(lasts, "; "));
    } else {
      out += "the ranks issued different collectives";
    }
    for (const auto& [kind, ranks] : kinds) {
      out += fmt::format("; {} issued {}", rank_list(ranks), texts[kind]);
    }
    return out;
  }
  return std::nullopt;
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 2 || std::string(argv[1]) == "--help") {
    std::fprintf(stderr, "usage: fr_trace DIR (the flight records rank_<R>.json of one job)\n");
    return 2;
  }
  std::map<int, json> records;
  std::error_code ec;
  for (const auto& file : fs::directory_iterator(argv[1], ec)) {
    const std::string name = file.path().filename().string();
    if (name.rfind("rank_", 0) != 0 || file.path().extension() != ".json") {
      continue;
    }
    try {
      std::ifstream in(file.path());
      json j = json::parse(in);
      const int rank = j["rank"].get<int>();
      records[rank] = std::move(j);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fr_trace: %s is not a flight record: %s\n", file.path().c_str(),
                   e.what());
      return 2;
    }
  }
  if (ec || records.empty()) {
    std::fprintf(stderr, "fr_trace: no flight records (rank_<R>.json) in %s%s%s\n", argv[1],
                 ec ? ": " : "", ec ? ec.message().c_str() : "");
    return 2;
  }
  std::set<int> have;
  std::map<std::string, Communicator> comms;
  int world = 0;
  for (const auto& [rank, j] : records) {
    have.insert(rank);
    world = std::max(world, j["world_size"].get<int>());
    std::printf("rank %d (%s, pid %lld): %zu collectives held; %s\n", rank,
                j["host"].get<std::string>().c_str(), j["pid"].get<long long>(),
                j["entries"].size(), j["reason"].get<std::string>().c_str());
    for (const json& e : j["entries"]) {
      if (e["p2p"].get<bool>()) {
        continue;
      }
      Communicator& c = comms[e["group"].get<std::string>()];
      c.ranks = e["ranks"].get<std::vector<int>>();
      c.by_rank[rank][e["group_seq"].get<int64_t>()] = e;
    }
  }
  std::vector<int> missing;
  for (int r = 0; r < world; ++r) {
    if (have.count(r) == 0) {
      missing.push_back(r);
    }
  }
  if (!missing.empty()) {
    std::printf("no record from %s\n", rank_list(missing).c_str());
  }
  bool diverged = false;
  for (const auto& [name, c] : comms) {
    if (const auto d = first_divergence(c, have)) {
      std::printf("group %s: %s\n", name.c_str(), d->c_str());
      diverged = true;
    }
  }
  if (!diverged) {
    std::printf("the ranks issued the same collectives on every group%s\n",
                missing.empty() ? "" : " (of the records read)");
  }
  return 0;
}
