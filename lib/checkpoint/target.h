#pragma once

// Where a save may write and what it may replace ([Note: what a save may replace] in
// target.cpp; docs/checkpoint.md, "What a save replaces").
#include <filesystem>
#include <string>
#include <vector>

namespace dtensor::detail {

namespace fs = std::filesystem;

// What dtensor writes into a directory it publishes; its manifest names it.
enum class OutputKind { kCheckpoint, kHfExport };

// The manifest's file name, inside every checkpoint and export dtensor publishes.
inline constexpr const char* kManifest = ".dtensor-manifest.json";

// The directory a save publishes: the caller's path made absolute and normal, a final
// symbolic link resolved (the output goes where the link points; the link stays).
struct Target {
  fs::path dir;     // where the output is published
  std::string name; // how messages name it: the caller's path, and the link's target if any
};
Target resolve_target(const std::string& path);

// Throws dtensor::Error (prefixed by `what`) unless `target.dir` may be replaced: nothing
// there, an empty directory, or a complete output dtensor published (its manifest lists
// every entry). With `overwrite`, anything there may be replaced, except the file system's
// root, the home directory and the current directory or a directory above it.
void check_replaceable(const Target& target, bool overwrite, const std::string& what);

// Whether `dir` holds a complete output dtensor published (any kind), and why not.
bool is_output(const fs::path& dir, std::string* why = nullptr);

// An exclusive lock on saves into one target, held by the process that publishes from
// before anything is written until the output is published ([Note: one save at a time]).
class TargetLock {
 public:
  TargetLock(const fs::path& dir, const std::string& what);
  ~TargetLock();
  TargetLock(const TargetLock&) = delete;
  TargetLock& operator=(const TargetLock&) = delete;

 private:
  fs::path path_;
  int fd_ = -1;
};

// The hidden sibling the files are written into before publishing.
fs::path temp_dir_of(const fs::path& dir);
// Creates the temporary directory (and the target's parents), removing what a failed or
// killed earlier save left there. Call under the target's lock.
void make_temp_dir(const fs::path& tmp);
// Writes `text` as the file `path` (synced when `sync`); a failed write (a full disk) raises.
void write_text_file(const fs::path& path, const std::string& text, bool sync);
// Writes the manifest listing `files` into `tmp`.
void write_manifest(const fs::path& tmp, OutputKind kind, const std::vector<std::string>& files,
                    bool sync);
// Checks the target again (under its lock) and publishes `tmp` in its place in one atomic
// rename; what it replaced is removed afterwards.
void publish(const fs::path& tmp, const Target& target, bool overwrite, bool sync,
             const std::string& what);
// Syncs a directory's entries to disk.
void fsync_dir(const fs::path& dir);

} // namespace dtensor::detail
