#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <dtensor/collectives.h>

namespace c10 {
class DebugInfoGuard;
} // namespace c10

namespace dtensor {

// One collective as the choke point saw it.
struct CollectiveRecord {
  CollectiveKind kind;
  std::string group;        // the Group's label ("dp", "world", ...) or its ranks
  std::vector<int> ranks;   // global ranks of the group
  ReduceOp op = ReduceOp::Sum; // meaningful for AllReduce / ReduceScatter
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> shape; // of the input tensor
  int64_t bytes_in = 0;  // bytes this rank hands to the collective
  int64_t bytes_out = 0; // bytes this rank receives as its result
  bool async = false;
  // Where in its thread's work the collective was issued: the kernel FLOPs a StepRecorder had
  // counted in its phase by then (0 outside one). The time model's overlap windows ([Note:
  // the time model] in dtensor/simulate.h).
  int64_t issued_at = 0;
  // Where, in the same count, the issuing thread waited for an asynchronous collective, when
  // the wait came while this record's CommDebugMode still recorded (a StepRecorder's phase);
  // -1 otherwise: synchronous, waited after the phase, or never waited before being read
  // ([Note: waits on the timeline] in lib/mesh/comm_debug_mode.cpp).
  int64_t waited_at = -1;
};

// [Note: CommDebugMode]
// An RAII scope that records every collective issued through the choke point while it is
// alive. Scopes nest: a collective is recorded by every scope active on the issuing thread,
// inner and outer alike (as nested PyTorch dispatch modes both see it). A scope belongs to
// the thread that opened it and to the threads that run under that thread's captured
// at::ThreadLocalState (autograd's device threads, at::launch tasks, a std::thread under an
// at::ThreadLocalStateGuard): it travels in c10's ThreadLocalDebugInfo, which
// at::ThreadLocalState carries ([Note: CommDebugMode across threads] in
// lib/mesh/comm_debug_mode.cpp). Other threads are not seen. Scopes end in reverse order of
// opening; read the counts once the collectives of interest have completed.
//
//   dtensor::CommDebugMode mode;
//   ... run collectives ...
//   REQUIRE(mode.count(CollectiveKind::AllReduce) == 1);
//   std::cout << mode.table();
class CommDebugMode {
 public:
  CommDebugMode();
  ~CommDebugMode();
  CommDebugMode(const CommDebugMode&) = delete;
  CommDebugMode& operator=(const CommDebugMode&) = delete;

  // Counts per kind (kinds never seen are absent), like PyTorch's get_comm_counts().
  std::map<CollectiveKind, int64_t> comm_counts() const;
  int64_t count(CollectiveKind kind) const;
  int64_t total_count() const;
  // Counts per group label, then per kind.
  std::map<std::string, std::map<CollectiveKind, int64_t>> counts_by_group() const;
  int64_t count(const std::string& group, CollectiveKind kind) const;
  int64_t bytes_in(CollectiveKind kind) const;
  int64_t total_bytes_in() const;
  int64_t total_bytes_out() const;
  const std::vector<CollectiveRecord>& records() const;

  // A fixed-width table: one row per group, one column per kind, and bytes.
  std::string table() const;
  // {"total_count":..,"total_bytes_in":..,"counts":{..},"by_group":{..},"records":[..]}
  std::string json() const;
  void reset();

  // --- Per module, as PyTorch's CommDebugMode ([Note: module attribution]) ---------------
  // Modules are seen when they are called through dtensor::call (the module seam,
  // dtensor/module_hooks.h); names as PyTorch prints them: "Global", the root's class name
  // ("MLPModule"), then "MLPModule.net1"... A collective counts for the module running then
  // (in backward: the module whose outputs' gradient arrived last) and all its ancestors,
  // "Global" included, under forward or backward (inside autograd's backward).
  struct ModuleCollectives {
    std::map<CollectiveKind, int64_t> forward;
    std::map<CollectiveKind, int64_t> backward;
  };
  // PyTorch's comm_module_counts: modules that saw a collective, and "Global".
  std::map<std::string, ModuleCollectives> comm_module_counts() const;
  // PyTorch's generate_comm_debug_tracing_table / log_comm_debug_tracing_table_to_file /
  // generate_json_dump, with its noise levels: 0 module-level collective counts; 1 also
  // module types, parameters' placements and the DTensor operations (trivial ones left
  // out); 2 and 3 the same (dtensor records DTensor operations only; 3 adds the trivial
  // ones). The table has PyTorch's ANSI colours; the file version has none. The JSON's layout
  // is PyTorch's (fqn, module_type, parameters, children, collectives_forward / _backward,
  // operations_forward / _backward / _checkpointing); collectives are named as PyTorch names
  // them ("c10d_functional.all_reduce", ...).
  std::string generate_comm_debug_tracing_table(int noise_level = 3) const;
  void log_comm_debug_tracing_table_to_file(const std::string& file_name = "comm_mode_log.txt",
                                            int noise_level = 3) const;
  std::string json_dump(int noise_level = 3) const;
  void generate_json_dump(const std::string& file_name = "comm_mode_log.json",
                          int noise_level = 3) const;
  // PyTorch's get_sharding_info ("MLPModule.net1.weight" -> "(Shard(dim=0),)", DTensor
  // parameters of the modules seen) and get_parameter_info (module -> parameter name ->
  // the parameter).
  std::map<std::string, std::string> get_sharding_info() const;
  std::map<std::string, std::map<std::string, at::Tensor>> get_parameter_info() const;

  struct Log; // the records and their lock, shared with the threads carrying this scope

 private:
  std::shared_ptr<Log> log_;
  std::unique_ptr<c10::DebugInfoGuard> guard_;
};

} // namespace dtensor
