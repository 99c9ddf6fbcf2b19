#pragma once

// [Note: the flight recorder] Every rank keeps the last collectives it issued through the
// collective choke point (dtensor/collectives.h): the operation and what it moves, the
// communicator and its ranks, the number of collectives this rank had issued on that
// communicator before it (the same on every rank for the same call: the sequence number
// tools compare across ranks), the collective it was agreeing on sizes for, and whether it
// completed. When a collective fails (a timeout, a peer gone, ranks that disagree) or the
// process gets SIGTERM, SIGINT or SIGABRT, each rank writes its record as
// <folder>/rank_<R>.json; `fr_trace <folder>` reads every rank's record and names the first
// collective where the ranks diverge: who never issued it, who issued something else.
// PyTorch's recorder does this for NCCL only; this one is the same on every backend.
//
// Recording is on by default (the last 2000 collectives, a few hundred bytes each); dumping
// needs a folder, from flight_recorder_options or the environment:
//   DTENSOR_FLIGHT_RECORDER_DIR   the folder (created when missing)
//   DTENSOR_FLIGHT_RECORDER_SIZE  collectives kept (0: no recording)
#include <cstdint>
#include <string>

#include <torch/arg.h>

namespace dtensor {

struct FlightRecorderOptions {
  TORCH_ARG(int64_t, capacity) = 2000; // collectives kept per rank (0: none)
  TORCH_ARG(std::string, dump_folder) = ""; // "": no dump on failure
  // Dump on SIGTERM / SIGINT / SIGABRT too (the handlers then chain to those installed
  // before), as when torchrun stops the job's other ranks after one failed.
  TORCH_ARG(bool, dump_on_signal) = true;
};

// Sets the recorder's options (they replace those of the environment); keeps what it holds.
void set_flight_recorder(const FlightRecorderOptions& options);
FlightRecorderOptions flight_recorder_options();

// This rank's record as JSON: {"rank", "world_size", "host", "pid", "reason", "entries": [{
// "id", "op", "description", "agreeing_on", "group", "ranks", "group_seq", "p2p", "state"
// ("issued" | "completed" | "failed"), "issued_us", "completed_us"}]}.
std::string flight_record_json(const std::string& reason = "");

// Writes the record now as <dump_folder>/rank_<R>.json (written whole, then renamed into
// place) and returns its path; "" when no folder is set.
std::string dump_flight_record(const std::string& reason);

} // namespace dtensor
