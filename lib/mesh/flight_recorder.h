#pragma once

// The choke point's side of the flight recorder ([Note: the flight recorder] in
// dtensor/flight_recorder.h).
#include <cstdint>
#include <string>

#include <dtensor/process_group.h>

namespace dtensor::detail {

// A collective about to be issued on `group`: its entry's id (-1: not recording).
int64_t flight_issued(const std::string& what, const Group& group);
// Its outcome; a failure also dumps the record (once per process) with `error` as the reason.
void flight_completed(int64_t id);
void flight_failed(int64_t id, const std::string& error);
// A failure found outside one collective's call (ranks that disagree on sizes): dumps once.
void flight_failure(const std::string& error);

// A world began (this process's rank and the world's size) or ended (-1, 0): the next
// collective's communicators are new ones, numbered from 0, even at a former one's address.
// Lock-free: called under the world's lock, which the recorder never takes.
void flight_world(int rank, int world_size);

// While one lives on this thread, the collectives issued are an agreement on the sizes of
// `description` (the caller's collective), recorded as such ([Note: agreeing on sizes]).
class FlightAgreement {
 public:
  explicit FlightAgreement(const std::string& description);
  ~FlightAgreement();
  FlightAgreement(const FlightAgreement&) = delete;
  FlightAgreement& operator=(const FlightAgreement&) = delete;

 private:
  const std::string* previous_;
};

} // namespace dtensor::detail
