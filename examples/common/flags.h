#pragma once

// The command line of every program here (examples/, bench/, test/drivers/): one table of
// flags, each bound to the field it sets, with its help line; parsing, value checks and the
// usage text come from the table. Hand-written rather than a library (CLI11, cxxopts): the
// recipe's job files set the same flags by name through set(), with the same checks.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtensor::cli {

class FlagTable {
 public:
  // `program` prefixes errors ("train", "train --simulate"); `source` is where the flags are
  // described at length.
  FlagTable(std::string program, std::string source)
      : program_(std::move(program)), source_(std::move(source)) {}

  // A flag taking a value; `set` parses and stores it and throws std::exception on a bad one.
  // `shown`: the default in `--help` ("" for none).
  FlagTable& value(const char* name, const char* help,
                   std::function<void(const std::string&)> set, std::string shown = "") {
    flags_.push_back({name, help, std::move(set), true, std::move(shown)});
    return *this;
  }
  FlagTable& value(const char* name, const char* help, int64_t& target) {
    return value(
        name, help, [&target](const std::string& v) { target = parse_int(v); },
        std::to_string(target));
  }
  FlagTable& value(const char* name, const char* help, double& target) {
    char shown[32];
    std::snprintf(shown, sizeof shown, "%g", target);
    return value(
        name, help, [&target](const std::string& v) { target = parse_double(v); }, shown);
  }
  FlagTable& value(const char* name, const char* help, std::string& target,
                   std::vector<std::string> choices = {}) {
    const std::string shown = target.empty() ? "\"\"" : target;
    return value(
        name, help,
        [&target, choices = std::move(choices), name](const std::string& v) {
      if (!choices.empty() && std::find(choices.begin(), choices.end(), v) == choices.end()) {
        std::string all;
        for (const auto& c : choices) {
          all += (all.empty() ? "" : "|") + c;
        }
        throw std::invalid_argument(std::string(name) + " takes " + all);
      }
      target = v;
        },
        shown);
  }
  // A flag without a value: sets `target` to true (set() with "false": to false, as a job
  // file's key can).
  FlagTable& toggle(const char* name, const char* help, bool& target) {
    flags_.push_back({name, help, [&target](const std::string& v) { target = v != "false"; },
                      false, target ? "on" : "off"});
    return *this;
  }

  // Sets one flag as the command line would (a toggle ignores `value`); throws
  // std::invalid_argument for an unknown flag or a bad value instead of exiting.
  void set(const std::string& name, const std::string& value) const {
    const Flag* flag = find(name);
    if (flag == nullptr) {
      throw std::invalid_argument("unknown flag " + name);
    }
    try {
      flag->set(value);
    } catch (const std::exception& e) {
      throw std::invalid_argument("bad value '" + value + "' for " + name + " (" + e.what() + ")");
    }
  }

  // Parses argv[1..]. Flags not in the table go to `rest` (in order, with the word after
  // them) when it is given; otherwise they are an error.
  void parse(int argc, char** argv, std::vector<std::string>* rest = nullptr) const {
    for (int i = 1; i < argc; ++i) {
      const std::string k = argv[i];
      if (k == "--help") {
        std::fputs((usage() + epilogue_).c_str(), stdout);
        std::exit(0);
      }
      const Flag* flag = find(k);
      if (flag == nullptr) {
        if (rest == nullptr) {
          fail("unknown flag " + k);
        }
        rest->push_back(k);
        continue;
      }
      if (flag->takes_value && i + 1 >= argc) {
        fail("flag " + k + " needs a value");
      }
      const std::string v = flag->takes_value ? argv[++i] : "";
      try {
        flag->set(v);
      } catch (const std::exception& e) {
        fail("bad value '" + v + "' for " + k + " (" + e.what() + ")");
      }
    }
  }

  [[noreturn]] void fail(const std::string& why) const {
    std::fprintf(stderr, "%s: %s\n%s", program_.c_str(), why.c_str(), usage().c_str());
    std::exit(2);
  }

  // A whole integer / number, or std::invalid_argument.
  static int64_t parse_int(const std::string& v) {
    return parse_whole<int64_t>(
        v, [](const std::string& s, size_t* used) { return std::stoll(s, used); },
        "not an integer");
  }
  static double parse_double(const std::string& v) {
    return parse_whole<double>(
        v, [](const std::string& s, size_t* used) { return std::stod(s, used); }, "not a number");
  }
  std::string usage() const {
    std::string out = "flags (" + source_ + "):\n";
    for (const Flag& f : flags_) {
      out += "  " + f.name + (f.takes_value ? " V" : "") + "  " + f.help + "\n";
    }
    return out;
  }
  // Text `--help` prints after the flags.
  void set_epilogue(std::string text) { epilogue_ = std::move(text); }
  // The default of flag `name` as `--help` shows it ("" when none or unknown).
  std::string shown_default(const std::string& name) const {
    const Flag* f = find(name);
    return f == nullptr ? "" : f->shown;
  }

 private:
  // `convert` must take the whole of `v` (no trailing characters, no overflow).
  template <typename T, typename Convert>
  static T parse_whole(const std::string& v, Convert convert, const char* what) {
    size_t used = 0;
    T value{};
    try {
      value = convert(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != v.size()) {
      throw std::invalid_argument(what);
    }
    return value;
  }

  struct Flag {
    std::string name;
    std::string help;
    std::function<void(const std::string&)> set;
    bool takes_value;
    std::string shown;
  };

  const Flag* find(const std::string& name) const {
    for (const Flag& f : flags_) {
      if (f.name == name) {
        return &f;
      }
    }
    return nullptr;
  }

  std::string program_;
  std::string source_;
  std::string epilogue_;
  std::vector<Flag> flags_;
};

} // namespace dtensor::cli
