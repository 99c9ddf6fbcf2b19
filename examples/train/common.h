#pragma once

// What examples/train (and test/drivers/gpt_train.cpp) use: the text, muted output, the
// process's memory figures, and a checked write of an output file.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace dtensor::train {

// Writes `text` as the file `path` (replacing a file of that name: the tool's own output,
// in a directory the user named for it); a failed write (a directory there, a full disk)
// raises, naming the path, instead of leaving a truncated file unsaid.
inline void write_output(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) {
    throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
  }
}

inline const char* const kCorpus =
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way - in short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for "
    "good or for evil, in the superlative degree of comparison only. ";

// Gloo prints a "[Gloo] Rank N is connected to ..." line on stdout for every group it
// connects, and SentencePiece's trainer logs its command line on stderr: the example keeps
// its own output clean by muting that descriptor meanwhile (STDOUT_FILENO or STDERR_FILENO).
class Muted {
 public:
  explicit Muted(int fd) : fd_(fd), saved_(dup(fd)) {
    std::fflush(fd == STDOUT_FILENO ? stdout : stderr);
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) {
      dup2(null, fd_);
      close(null);
    }
  }
  ~Muted() {
    std::fflush(fd_ == STDOUT_FILENO ? stdout : stderr);
    if (saved_ >= 0) {
      dup2(saved_, fd_);
      close(saved_);
    }
  }
  Muted(const Muted&) = delete;
  Muted& operator=(const Muted&) = delete;

 private:
  int fd_;
  int saved_;
};

// A field of /proc/self/status in MiB ("VmRSS": resident now, "VmHWM": its peak).
inline double status_mib(const char* field) {
  double kib = 0;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    const size_t n = std::strlen(field);
    while (std::fgets(line, sizeof line, f) != nullptr) {
      if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
        kib = std::strtod(line + n + 1, nullptr);
        break;
      }
    }
    std::fclose(f);
  }
  return kib / 1024.0;
}

inline double resident_mib() {
  return status_mib("VmRSS");
}

inline double peak_resident_mib() {
  return status_mib("VmHWM");
}

// The recipe (examples/train/llama.cpp; argv without --model), its planner (simulate.cpp) and
// the layout search (plan.cpp).
int run_llama(int argc, char** argv);
int run_simulate(int argc, char** argv);
int run_plan(int argc, char** argv);

} // namespace dtensor::train
