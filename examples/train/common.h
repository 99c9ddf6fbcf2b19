#pragma once

// What both recipes of examples/train use: the text and its character vocabulary, Gloo's
// muted connection lines, and the process's memory figures.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace dtensor::train {

inline const char* const kCorpus =
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way - in short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for "
    "good or for evil, in the superlative degree of comparison only. ";

// The text as ids of its distinct characters (sorted), and back.
struct CharVocab {
  explicit CharVocab(const std::string& text) {
    std::set<char> chars(text.begin(), text.end());
    for (char c : chars) {
      index.emplace(c, static_cast<int64_t>(symbols.size()));
      symbols.push_back(c);
    }
  }
  std::vector<int64_t> encode(const std::string& text) const {
    std::vector<int64_t> ids;
    for (char c : text) {
      ids.push_back(index.at(c));
    }
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const {
    std::string out;
    for (int64_t i : ids) {
      out += i >= 0 && i < size() ? symbols[static_cast<size_t>(i)] : '?';
    }
    return out;
  }
  int64_t size() const { return static_cast<int64_t>(symbols.size()); }

  std::map<char, int64_t> index;
  std::vector<char> symbols;
};

// Gloo prints a "[Gloo] Rank N is connected to ..." line on stdout for every group it
// connects; the example keeps its own output clean by muting stdout while groups are made.
class MutedStdout {
 public:
  MutedStdout() : saved_(dup(STDOUT_FILENO)) {
    std::fflush(stdout);
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) {
      dup2(null, STDOUT_FILENO);
      close(null);
    }
  }
  ~MutedStdout() {
    std::fflush(stdout);
    if (saved_ >= 0) {
      dup2(saved_, STDOUT_FILENO);
      close(saved_);
    }
  }
  MutedStdout(const MutedStdout&) = delete;
  MutedStdout& operator=(const MutedStdout&) = delete;

 private:
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

// The recipes (examples/train/gpt.cpp, llama.cpp); argv without --model.
int run_gpt(int argc, char** argv);
int run_llama(int argc, char** argv);

} // namespace dtensor::train
