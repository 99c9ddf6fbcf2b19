// CommDebugMode: thread-local, nestable recording of the choke point's collectives.
#include <dtensor/comm_debug_mode.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>

#include <c10/util/ThreadLocalDebugInfo.h>

#include "internal/check.h"
#include "internal/torch_compat.h"
#include "mesh/comm_debug.h"
#include "mesh/comm_debug_log.h"

namespace dtensor {

namespace {

// [Note: CommDebugMode across threads]
// The active scopes live in c10::ThreadLocalDebugInfo under a kind of dtensor's own (a value
// beyond c10's kinds, compat::debug_info_kind), not in a thread_local: at::ThreadLocalState
// captures ThreadLocalDebugInfo and at::ThreadLocalStateGuard installs it, which is how
// autograd's engine runs backward on its device threads (CUDA) and at::launch runs tasks.
// A collective issued there, such as fully_shard's reduce-scatter in a CUDA backward, is then
// counted by the scopes of the thread that started the work. Each scope's records sit behind
// a lock, as several threads may append; the entry holds the logs by shared_ptr, so a thread
// still carrying a captured state after its scope ended appends to a log nobody reads.
constexpr std::string_view kCommDebugKindName = "dtensor::CommDebugMode";
const c10::DebugInfoKind kCommDebugKind =
    detail::compat::debug_info_kind(&kCommDebugKindName, 0xD7);

struct ActiveScopes : c10::DebugInfoBase {
  std::vector<std::shared_ptr<CommDebugMode::Log>> logs; // outermost first
};

const ActiveScopes* active_scopes() {
  return static_cast<const ActiveScopes*>(c10::ThreadLocalDebugInfo::get(kCommDebugKind));
}

constexpr CollectiveKind kAllKinds[kNumCollectiveKinds] = {
    CollectiveKind::AllReduce, CollectiveKind::AllGather, CollectiveKind::ReduceScatter,
    CollectiveKind::AllToAll,  CollectiveKind::Broadcast, CollectiveKind::Barrier,
    CollectiveKind::Send,      CollectiveKind::Recv};

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
    case '"':
      out += "\\\"";
      break;
    case '\\':
      out += "\\\\";
      break;
    case '\n':
      out += "\\n";
      break;
    default:
      if (static_cast<unsigned char>(c) < 0x20) {
        out += fmt::format("\\u{:04x}", static_cast<int>(c));
      } else {
        out += c;
      }
    }
  }
  return out + "\"";
}

std::string json_counts(const std::map<CollectiveKind, int64_t>& counts) {
  std::vector<std::string> items;
  for (const auto& [kind, n] : counts) {
    items.push_back(fmt::format("{}:{}", json_string(to_string(kind)), n));
  }
  return fmt::format("{{{}}}", fmt::join(items, ","));
}

} // namespace

CommDebugMode::CommDebugMode() : log_(std::make_shared<Log>()) {
  auto scopes = std::make_shared<ActiveScopes>();
  if (const ActiveScopes* outer = active_scopes()) {
    scopes->logs = outer->logs;
  }
  scopes->logs.push_back(log_);
  guard_ = std::make_unique<c10::DebugInfoGuard>(kCommDebugKind, std::move(scopes));
}

CommDebugMode::~CommDebugMode() = default; // the guard restores the enclosing scopes

const std::vector<CollectiveRecord>& CommDebugMode::records() const { return log_->records; }

void CommDebugMode::reset() {
  std::lock_guard<std::mutex> lock(log_->mutex);
  log_->records.clear();
  log_->modules.attribution.clear(); // the modules seen stay, their counts restart
  log_->modules.operations.clear();
}

namespace detail {

bool comm_debug_active() { return active_scopes() != nullptr; }

namespace {
std::atomic<IssueStamp> issue_stamp{nullptr};
} // namespace

void set_issue_stamp(IssueStamp stamp) { issue_stamp.store(stamp); }

// [Note: waits on the timeline]
// The time model overlaps an asynchronous collective with the compute between its issue and
// its wait. The choke point takes the marks of the records it just made (thread-local: the
// issuing thread's own, taken before it returns) and stamps them in Work::wait, on the
// waiting thread, only while that thread still records into the same log (a wait after the
// StepRecorder's phase ended is the phase's end, where the model waits for every stream
// anyway). A mark whose record went (a reset) is skipped.
thread_local std::vector<RecordMark> last_marks;

void record_collective(const CollectiveRecord& rec) {
  last_marks.clear();
  if (const ActiveScopes* scopes = active_scopes()) {
    const bool backward = in_autograd_backward();
    const IssueStamp stamp = issue_stamp.load();
    const int64_t issued_at = stamp != nullptr ? stamp() : 0;
    for (const auto& log : scopes->logs) {
      std::lock_guard<std::mutex> lock(log->mutex);
      log->records.push_back(rec);
      log->records.back().issued_at = issued_at;
      log->modules.attribution.emplace_back(log->modules.current, backward);
      last_marks.push_back({log, log->records.size() - 1, issued_at});
    }
  }
}

std::vector<RecordMark> take_record_marks() { return std::exchange(last_marks, {}); }

void record_wait(const std::vector<RecordMark>& marks) {
  const ActiveScopes* scopes = active_scopes();
  if (scopes == nullptr || marks.empty()) {
    return;
  }
  const IssueStamp stamp = issue_stamp.load();
  const int64_t at = stamp != nullptr ? stamp() : 0;
  for (const auto& mark : marks) {
    const auto log = mark.log.lock();
    if (!log || std::find(scopes->logs.begin(), scopes->logs.end(), log) == scopes->logs.end()) {
      continue;
    }
    std::lock_guard<std::mutex> lock(log->mutex);
    if (mark.index < log->records.size() && log->records[mark.index].issued_at == mark.issued_at) {
      log->records[mark.index].waited_at = at;
    }
  }
}

std::vector<std::shared_ptr<CommDebugMode::Log>> active_logs() {
  const ActiveScopes* scopes = active_scopes();
  return scopes ? scopes->logs : std::vector<std::shared_ptr<CommDebugMode::Log>>{};
}

} // namespace detail

std::map<CollectiveKind, int64_t> CommDebugMode::comm_counts() const {
  std::map<CollectiveKind, int64_t> counts;
  for (const auto& r : records()) {
    ++counts[r.kind];
  }
  return counts;
}

int64_t CommDebugMode::count(CollectiveKind kind) const {
  return std::count_if(records().begin(), records().end(),
                       [&](const CollectiveRecord& r) { return r.kind == kind; });
}

int64_t CommDebugMode::total_count() const { return static_cast<int64_t>(records().size()); }

std::map<std::string, std::map<CollectiveKind, int64_t>> CommDebugMode::counts_by_group() const {
  std::map<std::string, std::map<CollectiveKind, int64_t>> counts;
  for (const auto& r : records()) {
    ++counts[r.group][r.kind];
  }
  return counts;
}

int64_t CommDebugMode::count(const std::string& group, CollectiveKind kind) const {
  return std::count_if(records().begin(), records().end(), [&](const CollectiveRecord& r) {
    return r.kind == kind && r.group == group;
  });
}

int64_t CommDebugMode::bytes_in(CollectiveKind kind) const {
  int64_t total = 0;
  for (const auto& r : records()) {
    if (r.kind == kind) {
      total += r.bytes_in;
    }
  }
  return total;
}

int64_t CommDebugMode::total_bytes_in() const {
  int64_t total = 0;
  for (const auto& r : records()) {
    total += r.bytes_in;
  }
  return total;
}

int64_t CommDebugMode::total_bytes_out() const {
  int64_t total = 0;
  for (const auto& r : records()) {
    total += r.bytes_out;
  }
  return total;
}

std::string CommDebugMode::table() const {
  // One row per group in first-seen order, then a total row.
  std::vector<std::string> groups;
  for (const auto& r : records()) {
    if (std::find(groups.begin(), groups.end(), r.group) == groups.end()) {
      groups.push_back(r.group);
    }
  }
  size_t width = 5;
  for (const auto& g : groups) {
    width = std::max(width, g.size());
  }
  std::string out = fmt::format("CommDebugMode: {} collective(s), {} bytes in, {} bytes out\n",
                                total_count(), total_bytes_in(), total_bytes_out());
  out += fmt::format("{:<{}}", "group", width);
  for (CollectiveKind k : kAllKinds) {
    out += fmt::format(" {:>14}", to_string(k));
  }
  out += fmt::format(" {:>12} {:>12}\n", "bytes_in", "bytes_out");
  auto row = [&](const std::string& name, const std::string& group) {
    int64_t in = 0;
    int64_t outb = 0;
    std::string line = fmt::format("{:<{}}", name, width);
    for (CollectiveKind k : kAllKinds) {
      int64_t n = 0;
      for (const auto& r : records()) {
        if (r.kind == k && (group.empty() || r.group == group)) {
          ++n;
        }
      }
      line += fmt::format(" {:>14}", n);
    }
    for (const auto& r : records()) {
      if (group.empty() || r.group == group) {
        in += r.bytes_in;
        outb += r.bytes_out;
      }
    }
    return line + fmt::format(" {:>12} {:>12}\n", in, outb);
  };
  for (const auto& g : groups) {
    out += row(g, g);
  }
  out += row("total", "");
  return out;
}

std::string CommDebugMode::json() const {
  std::vector<std::string> by_group;
  for (const auto& [group, counts] : counts_by_group()) {
    by_group.push_back(fmt::format("{}:{}", json_string(group), json_counts(counts)));
  }
  std::vector<std::string> recs;
  for (const auto& r : records()) {
    recs.push_back(fmt::format(
        "{{\"kind\":{},\"group\":{},\"ranks\":[{}],\"op\":{},\"dtype\":{},\"shape\":[{}],"
        "\"bytes_in\":{},\"bytes_out\":{},\"async\":{}}}",
        json_string(to_string(r.kind)), json_string(r.group), fmt::join(r.ranks, ","),
        json_string(to_string(r.op)), json_string(c10::toString(r.dtype)),
        fmt::join(r.shape, ","), r.bytes_in, r.bytes_out, r.async ? "true" : "false"));
  }
  return fmt::format("{{\"total_count\":{},\"total_bytes_in\":{},\"total_bytes_out\":{},"
                     "\"counts\":{},\"by_group\":{{{}}},\"records\":[{}]}}",
                     total_count(), total_bytes_in(), total_bytes_out(),
                     json_counts(comm_counts()), fmt::join(by_group, ","),
                     fmt::join(recs, ","));
}

} // namespace dtensor
