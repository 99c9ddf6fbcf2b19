// The flight recorder ([Note: the flight recorder] in dtensor/flight_recorder.h).
#include <dtensor/flight_recorder.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <nlohmann/json.hpp>

#include "internal/check.h"
#include "mesh/flight_recorder.h"

namespace dtensor {

namespace {
namespace flight { // unique names: the library is built in unity chunks

// A communicator as records name it, shared by its entries (a simulated world's groups hold
// thousands of ranks).
struct GroupInfo {
  std::string name;
  std::vector<int> ranks;
};

struct Entry {
  int64_t id = 0;
  std::string op, description, agreeing_on;
  std::shared_ptr<const GroupInfo> group;
  int64_t group_seq = 0;
  bool p2p = false;
  const char* state = "issued";
  int64_t issued_us = 0, completed_us = 0;
};

int64_t now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? fallback : std::atoll(v);
}

struct Recorder {
  std::mutex mutex;
  FlightRecorderOptions options = FlightRecorderOptions()
                                      .capacity(env_int("DTENSOR_FLIGHT_RECORDER_SIZE", 2000))
                                      .dump_folder([] {
                                        const char* d = std::getenv("DTENSOR_FLIGHT_RECORDER_DIR");
                                        return d == nullptr ? std::string() : std::string(d);
                                      }());
  std::deque<Entry> entries; // ids entries.front().id .. next_id - 1
  int64_t next_id = 0;
  // Collectives issued per communicator (its c10d backend), for the next one's group_seq;
  // point-to-point transfers, which differ between the two ends by nature, numbered apart.
  std::map<std::pair<const void*, bool>, int64_t> group_seq;
  std::map<const void*, std::shared_ptr<const GroupInfo>> groups;
  std::atomic<bool> dumped{false}; // a failure's dump is written once
  bool signals_installed = false;
  int64_t generation = -1; // the world whose communicators `groups` holds (flight_world)
};

// The world as flight_world last said: its rank and size, and a count of worlds begun and
// ended (a former communicator's address may come back as a new one).
std::atomic<int> recorded_rank{-1};
std::atomic<int> recorded_world_size{0};
std::atomic<int64_t> recorded_generation{0};

Recorder& recorder() {
  static auto* r = new Recorder(); // never destroyed: signal handlers may read it at exit
  return *r;
}

thread_local const std::string* agreeing_on = nullptr;

// The op's name: what precedes "(" in the choke point's description ("all_reduce(sum, ...)").
std::string op_of(const std::string& what) {
  return what.substr(0, what.find('('));
}

nlohmann::json to_json(const Entry& e) {
  return {{"id", e.id},
          {"op", e.op},
          {"description", e.description},
          {"agreeing_on", e.agreeing_on},
          {"group", e.group->name},
          {"ranks", e.group->ranks},
          {"group_seq", e.group_seq},
          {"p2p", e.p2p},
          {"state", e.state},
          {"issued_us", e.issued_us},
          {"completed_us", e.completed_us}};
}

std::string host_name() {
  char name[256] = {};
  return gethostname(name, sizeof name - 1) == 0 ? std::string(name) : std::string("?");
}

int this_rank() {
  const int rank = recorded_rank.load();
  return rank >= 0 ? rank : static_cast<int>(env_int("RANK", 0));
}

// Caller holds the mutex: a new world's first collective forgets the last world's
// communicators.
void follow_world(Recorder& r) {
  const int64_t generation = recorded_generation.load();
  if (generation != r.generation) {
    r.generation = generation;
    r.groups.clear();
    r.group_seq.clear();
  }
}

// Caller holds the mutex (or, in a signal handler, got it with try_lock).
std::string record_json(Recorder& r, const std::string& reason) {
  nlohmann::json j{{"rank", this_rank()},
                   {"world_size", recorded_world_size.load() > 0 ? recorded_world_size.load()
                                                                 : env_int("WORLD_SIZE", 1)},
                   {"host", host_name()},
                   {"pid", static_cast<int64_t>(getpid())},
                   {"reason", reason},
                   {"capacity", r.options.capacity()}};
  nlohmann::json entries = nlohmann::json::array();
  for (const Entry& e : r.entries) {
    entries.push_back(to_json(e));
  }
  j["entries"] = std::move(entries);
  return j.dump(1);
}

// A flight record this library wrote (its JSON's first key, as dump(1) sorts them).
bool is_record(const std::filesystem::path& path) {
  static const std::string first = "{\n \"capacity\":";
  std::ifstream in(path, std::ios::binary);
  std::string head(first.size(), '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  return in.gcount() == static_cast<std::streamsize>(head.size()) && head == first;
}

// Written whole under a temporary name, then renamed: a reader never sees half a record. A
// file of that name the recorder did not write is not replaced: the record then takes this
// process's id in its name (rank_<R>.<pid>.json).
std::string write_record(Recorder& r, const std::string& reason) {
  const std::string folder = r.options.dump_folder();
  if (folder.empty()) {
    return "";
  }
  std::filesystem::create_directories(folder);
  const std::string stem = "rank_" + std::to_string(this_rank());
  auto path = std::filesystem::path(folder) / (stem + ".json");
  if (std::filesystem::exists(path) && !is_record(path)) { // not ours: left alone
    path = std::filesystem::path(folder) / (stem + "." + std::to_string(getpid()) + ".json");
  }
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << record_json(r, reason) << "\n";
    if (!out) {
      throw std::runtime_error("cannot write " + tmp);
    }
  }
  std::filesystem::rename(tmp, path);
  return path.string();
}

// The first failure's dump; a failing dump only says so (the failure itself is what the
// caller raises).
void dump_once(Recorder& r, const std::string& reason) {
  if (r.options.dump_folder().empty() || r.dumped.exchange(true)) {
    return;
  }
  try {
    const std::string path = write_record(r, reason);
    std::fprintf(stderr, "dtensor: rank %d: flight record in %s\n", this_rank(), path.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtensor: the flight record could not be written: %s\n", e.what());
  }
}

// [Note: dumping on a signal] Best effort: the handler takes the recorder's lock only if it
// is free (a thread interrupted while holding it would never release it), writes the
// record, then restores the handler that was there before and raises the signal again.
constexpr int kSignals[] = {SIGTERM, SIGINT, SIGABRT};
struct sigaction previous_actions[3];

void on_signal(int sig) {
  Recorder& r = recorder();
  if (!r.dumped.exchange(true) && r.mutex.try_lock()) {
    try {
      write_record(r, std::string("signal ") + strsignal(sig));
    } catch (...) { // nothing to be done about it here
    }
    r.mutex.unlock();
  }
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    if (kSignals[i] == sig) {
      sigaction(sig, &previous_actions[i], nullptr);
    }
  }
  raise(sig);
}

// Caller holds the mutex.
void install_signals(Recorder& r) {
  if (r.signals_installed || !r.options.dump_on_signal() || r.options.dump_folder().empty()) {
    return;
  }
  r.signals_installed = true;
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    sigaction(kSignals[i], &action, &previous_actions[i]);
  }
}

Entry* find(Recorder& r, int64_t id) {
  if (id < 0 || r.entries.empty() || id < r.entries.front().id) {
    return nullptr; // no longer held
  }
  return &r.entries[static_cast<size_t>(id - r.entries.front().id)];
}

} // namespace flight
} // namespace

using namespace flight;

void set_flight_recorder(const FlightRecorderOptions& options) {
  DTENSOR_CHECK(options.capacity() >= 0, "set_flight_recorder: capacity {} must be >= 0",
                options.capacity());
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.options = options;
  while (static_cast<int64_t>(r.entries.size()) > options.capacity()) {
    r.entries.pop_front();
  }
}

FlightRecorderOptions flight_recorder_options() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.options;
}

std::string flight_record_json(const std::string& reason) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return record_json(r, reason);
}

std::string dump_flight_record(const std::string& reason) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return write_record(r, reason);
}

namespace detail {

int64_t flight_issued(const std::string& what, const Group& group) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.options.capacity() == 0) {
    return -1;
  }
  install_signals(r);
  follow_world(r);
  Entry e;
  e.id = r.next_id++;
  e.op = op_of(what);
  e.p2p = e.op == "send" || e.op == "recv";
  e.description = what;
  if (agreeing_on != nullptr) {
    e.agreeing_on = *agreeing_on;
  }
  const void* communicator = group.backend().get();
  std::shared_ptr<const GroupInfo>& info = r.groups[communicator];
  if (!info) {
    info = std::make_shared<const GroupInfo>(GroupInfo{group.to_string(), group.ranks()});
  }
  e.group = info;
  e.group_seq = r.group_seq[{communicator, e.p2p}]++;
  e.issued_us = now_us();
  r.entries.push_back(std::move(e));
  if (static_cast<int64_t>(r.entries.size()) > r.options.capacity()) {
    r.entries.pop_front();
  }
  return r.next_id - 1;
}

void flight_completed(int64_t id) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (Entry* e = find(r, id)) {
    e->state = "completed";
    e->completed_us = now_us();
  }
}

void flight_failed(int64_t id, const std::string& error) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (Entry* e = find(r, id)) {
    e->state = "failed";
    e->completed_us = now_us();
  }
  dump_once(r, error);
}

void flight_failure(const std::string& error) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  dump_once(r, error);
}

void flight_world(int rank, int size) {
  flight::recorded_rank = rank;
  flight::recorded_world_size = size;
  ++flight::recorded_generation;
}

FlightAgreement::FlightAgreement(const std::string& description) : previous_(agreeing_on) {
  agreeing_on = &description;
}

FlightAgreement::~FlightAgreement() {
  agreeing_on = previous_;
}

} // namespace detail

} // namespace dtensor
