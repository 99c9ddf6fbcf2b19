// Where a save may write and what it may replace (target.h).
#include "checkpoint/target.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "internal/check.h"

namespace dtensor::detail {

// [Note: what a save may replace]
// A save publishes a whole directory in one rename, replacing what was at the target. It
// must never delete what it did not write (a user's run folder, a file, "." or "~"), so
// every directory dtensor publishes carries a manifest naming each entry it wrote; a target
// is replaced only when it is absent, an empty directory, or a complete output whose
// manifest lists exactly what is there (a file added or removed since makes it foreign).
// Anything else is refused before anything is written, on every rank, unless the caller
// passes overwrite. The check runs twice: before the save writes anything, and again under
// the target's lock just before the exchange, so that what arrived in between is not lost.

namespace {

using safetensors::errno_text;

// "what: " before a message, or nothing (the caller's agreement names the call).
std::string prefix(const std::string& what) {
  return what.empty() ? "" : what + ": ";
}

std::string entry_count(size_t n) {
  return fmt::format("{} entr{}", n, n == 1 ? "y" : "ies");
}

std::string kind_name(OutputKind kind) {
  return kind == OutputKind::kCheckpoint ? "checkpoint" : "hf-export";
}

// A few names of `names` for a message.
std::string some_of(const std::vector<std::string>& names) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min<size_t>(names.size(), 4));
  return fmt::format("{}{}", fmt::join(shown, ", "),
                     names.size() > 4 ? fmt::format(" and {} more", names.size() - 4) : "");
}

std::vector<std::string> entries_of(const fs::path& dir) {
  std::vector<std::string> out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    out.push_back(e.path().filename().string() + (e.is_directory() ? "/" : ""));
  }
  std::sort(out.begin(), out.end());
  return out;
}

enum class Found { kNothing, kEmptyDir, kOutput, kOther };

struct Inspection {
  Found found = Found::kNothing;
  std::string what; // for kOther: "a regular file", "a directory holding ...", ...
};

Inspection inspect(const fs::path& dir) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    DTENSOR_FAIL("cannot inspect {}: {}", dir.string(), ec.message());
  }
  if (!fs::exists(st)) {
    return {Found::kNothing, ""};
  }
  if (fs::is_regular_file(st)) {
    return {Found::kOther, "a regular file"};
  }
  if (!fs::is_directory(st)) {
    return {Found::kOther, fs::is_symlink(st) ? "a symbolic link" : "a special file"};
  }
  if (fs::is_empty(dir)) {
    return {Found::kEmptyDir, ""};
  }
  std::string why;
  if (is_output(dir, &why)) {
    return {Found::kOutput, ""};
  }
  return {Found::kOther, why};
}

// The file system's root, the home directory, the current directory and those above it.
std::string guarded(const fs::path& dir) {
  std::error_code ec;
  const fs::path d = fs::weakly_canonical(dir, ec);
  if (ec) {
    return "";
  }
  if (d == d.root_path()) {
    return "the file system's root";
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    if (fs::weakly_canonical(home, ec) == d && !ec) {
      return "the home directory";
    }
  }
  const fs::path cwd = fs::weakly_canonical(fs::current_path(ec), ec);
  if (!ec) {
    if (std::mismatch(d.begin(), d.end(), cwd.begin(), cwd.end()).first == d.end()) {
      return cwd == d ? "the current directory" : "a directory above the current one";
    }
  }
  return "";
}

} // namespace

Target resolve_target(const std::string& path) {
  DTENSOR_CHECK(!path.empty(), "checkpoint: an empty path names no directory");
  fs::path p = fs::absolute(path).lexically_normal();
  if (p.filename().empty()) { // "ckpt/" names "ckpt"
    p = p.parent_path();
  }
  Target t{p, p.string()};
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(p, ec))) {
    const fs::path to = fs::canonical(p, ec);
    DTENSOR_CHECK(!ec, "checkpoint: {} is a symbolic link to {}, which does not exist", p.string(),
                  fs::read_symlink(p).string());
    t.dir = to;
    t.name = fmt::format("{} (a symbolic link to {})", p.string(), to.string());
  }
  return t;
}

bool is_output(const fs::path& dir, std::string* why) {
  const auto fail = [&](std::string text) {
    if (why != nullptr) {
      *why = std::move(text);
    }
    return false;
  };
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return fail("not a directory");
  }
  const std::vector<std::string> names = entries_of(dir);
  const fs::path manifest = dir / kManifest;
  if (!fs::is_regular_file(manifest, ec)) {
    return fail(fmt::format("a directory holding {} dtensor did not write ({}; it has no {})",
                            entry_count(names.size()), some_of(names), kManifest));
  }
  std::set<std::string> listed;
  try {
    std::ifstream f(manifest);
    const nlohmann::json m = nlohmann::json::parse(f);
    DTENSOR_CHECK(m.at("writer") == "dtensor", "written by {}", m.at("writer").dump());
    for (const auto& name : m.at("files")) {
      listed.insert(name.get<std::string>());
    }
  } catch (const std::exception& e) {
    return fail(fmt::format("a directory whose {} is unreadable ({})", kManifest, e.what()));
  }
  std::vector<std::string> foreign, missing;
  for (const std::string& e : names) {
    if (e != kManifest && listed.count(e) == 0) {
      foreign.push_back(e);
    }
  }
  for (const std::string& name : listed) {
    if (!fs::is_regular_file(dir / name, ec)) {
      missing.push_back(name);
    }
  }
  if (!foreign.empty()) {
    return fail(fmt::format("a dtensor output with entries added since it was written ({})",
                            some_of(foreign)));
  }
  if (!missing.empty()) {
    return fail(fmt::format("an incomplete dtensor output (missing {})", some_of(missing)));
  }
  return true;
}

void check_replaceable(const Target& target, bool overwrite, const std::string& what) {
  const Inspection found = inspect(target.dir);
  if (found.found == Found::kNothing) {
    return;
  }
  const std::string guard = guarded(target.dir);
  DTENSOR_CHECK(guard.empty(), "{}{} is {}, which a save never replaces; nothing was written",
                prefix(what), target.name, guard);
  DTENSOR_CHECK(found.found != Found::kOther || overwrite,
                "{}{} is {}; a save replaces only an empty directory or a complete dtensor "
                "checkpoint, so nothing was written. Choose another path, or pass overwrite "
                "(SaveOptions().overwrite(true)) to replace what is there",
                prefix(what), target.name, found.what);
}

TargetLock::TargetLock(const fs::path& dir, const std::string& what)
    : path_(dir.parent_path() / ("." + dir.filename().string() + ".dtensor-lock")) {
  // [Note: one save at a time] Two jobs saving into one target would write into the same
  // temporary directory and publish each other's halves. The publishing rank holds an
  // exclusive flock on a hidden sibling file (released by the kernel if it dies); a second
  // save finds it held and fails at once. The file is removed while still locked; a
  // process that locked the removed file sees that its inode is no longer the path's and
  // tries again.
  for (;;) {
    const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    DTENSOR_CHECK(fd >= 0, "{}cannot create the lock file {}: {}", prefix(what), path_.string(),
                  errno_text());
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      ::close(fd);
      DTENSOR_CHECK(e != EWOULDBLOCK,
                    "{}another save into {} is in progress (it holds {}); nothing was written",
                    prefix(what), dir.string(), path_.string());
      DTENSOR_FAIL("{}cannot lock {}: {}", prefix(what), path_.string(), std::strerror(e));
    }
    struct stat held {
    }, now{};
    if (::fstat(fd, &held) == 0 && ::stat(path_.c_str(), &now) == 0 && held.st_ino == now.st_ino &&
        held.st_dev == now.st_dev) {
      fd_ = fd;
      return;
    }
    ::close(fd);
  }
}

TargetLock::~TargetLock() {
  ::unlink(path_.c_str());
  ::close(fd_);
}

fs::path temp_dir_of(const fs::path& dir) {
  return dir.parent_path() / ("." + dir.filename().string() + ".dtensor-tmp");
}

void make_temp_dir(const fs::path& tmp) {
  fs::remove_all(tmp); // what a failed or killed save left
  fs::create_directories(tmp);
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DTENSOR_CHECK(fd >= 0, "checkpoint: cannot open directory {}: {}", dir.string(), errno_text());
  const int rc = ::fsync(fd);
  ::close(fd);
  DTENSOR_CHECK(rc == 0, "checkpoint: cannot sync directory {}: {}", dir.string(), errno_text());
}

void write_text_file(const fs::path& path, const std::string& text, bool sync) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DTENSOR_CHECK(fd >= 0, "checkpoint: cannot create {}: {}", path.string(), errno_text());
  try {
    safetensors::write_all(fd, text.data(), static_cast<int64_t>(text.size()), path.string());
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (sync && ::fsync(fd) != 0) {
    const std::string e = errno_text();
    ::close(fd);
    DTENSOR_FAIL("checkpoint: cannot sync {}: {}", path.string(), e);
  }
  DTENSOR_CHECK(::close(fd) == 0, "checkpoint: cannot write {}: {}", path.string(), errno_text());
}

void write_manifest(const fs::path& tmp, OutputKind kind, const std::vector<std::string>& files,
                    bool sync) {
  const nlohmann::json m = {
      {"writer", "dtensor"}, {"version", 1}, {"kind", kind_name(kind)}, {"files", files}};
  write_text_file(tmp / kManifest, m.dump(2) + "\n", sync);
}

void publish(const fs::path& tmp, const Target& target, bool overwrite, bool sync,
             const std::string& what) {
  if (sync) {
    fsync_dir(tmp);
  }
  check_replaceable(target, overwrite, what); // again: what arrived since the first check
  const fs::path& dir = target.dir;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dir, ec))) {
    DTENSOR_CHECK(::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_NOREPLACE) == 0,
                  "{}cannot publish {} as {}: {}", prefix(what), tmp.string(), dir.string(),
                  errno_text());
  } else {
    DTENSOR_CHECK(::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0,
                  "{}cannot replace {} by {}: {}", prefix(what), dir.string(), tmp.string(),
                  errno_text());
    fs::remove_all(tmp, ec); // now what was replaced; a leftover is cleared by the next save
  }
  if (sync) {
    fsync_dir(dir.parent_path());
  }
}

} // namespace dtensor::detail
