// dtensor::checkpoint::save_hf (include/dtensor/checkpoint.h).
#include <dtensor/checkpoint.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include <dtensor/process_group.h>

#include "checkpoint/layout.h"
#include "checkpoint/prepared.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/target.h"
#include "internal/check.h"
#include "mesh/agree.h"

namespace dtensor::checkpoint {

namespace fs = std::filesystem;
namespace st = detail::safetensors;

namespace {
namespace hf_save { // its own names in a unity unit ([Note: unity units] in lib/meson.build)

// [Note: Hugging Face export in place] A Hugging Face folder holds full tensors, several to a
// file. PyTorch's DCP writes one file per rank and then merges them into Hugging Face's files
// (every byte written twice and read once more). Here every rank knows every tensor's dtype
// and global shape (the write plan's exchange), so every rank computes the same files, headers
// and byte offsets. Rank 0 creates the files (header, then the data's full length) in the
// temporary directory; then each rank writes the pieces save() would give it straight to their
// places, one write per contiguous run of a piece's rows (a row-sharded piece is one run; a
// column-sharded one a run per row). Each byte is written once, by a rank that holds it; no
// rank gathers anything. The files are synced by their writers before rank 0 publishes.

// One stored tensor of the folder: planned tensor `tensor`, or row `row` of it (unstacked).
struct Entry {
  size_t tensor = 0;
  int64_t row = -1;
  st::Item item;
};

struct FilePlan {
  std::string name;
  std::vector<size_t> entries;
  std::string header; // the padded JSON
  int64_t size = 0;
};

struct Layout {
  std::vector<Entry> entries;
  std::vector<FilePlan> files;
  std::vector<std::pair<size_t, int64_t>> place; // per entry: its file, its data's offset there
  std::map<std::string, size_t> tensor_index;    // planned tensor key -> index
  std::vector<std::vector<size_t>> entries_of;   // per planned tensor: its entries (by row)
};

int64_t bytes_of(const st::Item& item) {
  return c10::multiply_integers(item.shape.begin(), item.shape.end()) *
         static_cast<int64_t>(c10::elementSize(item.dtype));
}

std::vector<Entry> entries_of(const detail::WritePlan& plan, const HfSaveOptions& options,
                              const std::string& what) {
  std::vector<Entry> out;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const detail::PlannedTensor& t = plan.tensors[i];
    auto stack = options.unstack().find(t.key);
    if (stack == options.unstack().end()) {
      out.push_back(
          {i, -1, {t.key, t.dtype, t.shape, std::vector<int64_t>(t.shape.size(), 0), {}}});
      continue;
    }
    DTENSOR_CHECK(!t.shape.empty(), "{}: '{}' is a scalar: it has no rows to unstack", what, t.key);
    const std::vector<int64_t> row(t.shape.begin() + 1, t.shape.end());
    for (int64_t r = 0; r < t.shape[0]; ++r) {
      out.push_back({i,
                     r,
                     {detail::stacked_name(stack->second, r),
                      t.dtype,
                      row,
                      std::vector<int64_t>(row.size(), 0),
                      {}}});
    }
  }
  std::set<std::string> names;
  for (const Entry& e : out) {
    DTENSOR_CHECK(names.insert(e.item.key).second, "{}: two tensors would be stored as '{}'", what,
                  e.item.key);
  }
  return out;
}

// The same on every rank: which entry goes to which file, and where.
Layout plan_files(const detail::WritePlan& plan, const HfSaveOptions& options,
                  const std::string& what) {
  DTENSOR_CHECK(options.max_shard_bytes() > 0, "{}: max_shard_bytes is {}; it must be positive",
                what, options.max_shard_bytes());
  for (const auto& [key, pattern] : options.unstack()) {
    DTENSOR_CHECK(std::any_of(plan.tensors.begin(), plan.tensors.end(),
                              [&](const detail::PlannedTensor& t) { return t.key == key; }),
                  "{}: no tensor '{}' to unstack as '{}'", what, key, pattern);
  }
  Layout l;
  l.entries = entries_of(plan, options, what);
  int64_t filled = 0;
  for (size_t e = 0; e < l.entries.size(); ++e) {
    const int64_t bytes = bytes_of(l.entries[e].item);
    if (l.files.empty() ||
        (!l.files.back().entries.empty() && filled + bytes > options.max_shard_bytes())) {
      l.files.emplace_back();
      filled = 0;
    }
    l.files.back().entries.push_back(e);
    filled += bytes;
  }
  l.place.resize(l.entries.size());
  const size_t n = l.files.size();
  for (size_t f = 0; f < n; ++f) {
    FilePlan& file = l.files[f];
    file.name =
        n == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", f + 1, n);
    std::vector<st::Item> items;
    for (size_t e : file.entries) {
      items.push_back(l.entries[e].item);
    }
    st::WriteOptions wo;
    wo.sharding_info = false;
    std::vector<int64_t> offsets;
    int64_t data = 0;
    file.header = st::header_text(items, wo, &offsets, &data);
    const int64_t start = 8 + static_cast<int64_t>(file.header.size());
    file.size = start + data;
    for (size_t k = 0; k < file.entries.size(); ++k) {
      l.place[file.entries[k]] = {f, start + offsets[k]};
    }
  }
  l.entries_of.resize(plan.tensors.size());
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    l.tensor_index[plan.tensors[i].key] = i;
  }
  for (size_t e = 0; e < l.entries.size(); ++e) {
    l.entries_of[l.entries[e].tensor].push_back(e);
  }
  return l;
}

void pwrite_all(int fd, const char* p, int64_t bytes, int64_t at, const std::string& path) {
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, static_cast<size_t>(std::min<int64_t>(bytes, 1 << 30)),
                               static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    DTENSOR_CHECK(n > 0, "checkpoint: cannot write {}: {}", path, st::errno_text());
    p += n;
    at += n;
    bytes -= n;
  }
}

// Writes `block` (contiguous, the piece at `offsets` of a tensor of `shape` stored from byte
// `start`) to its place: one write per contiguous run.
void write_block(int fd, const std::string& path, const at::Tensor& block,
                 const std::vector<int64_t>& shape, const std::vector<int64_t>& offsets,
                 int64_t start) {
  if (block.numel() == 0) {
    return;
  }
  const auto elem = static_cast<int64_t>(block.element_size());
  const auto* data = static_cast<const char*>(block.const_data_ptr());
  const int64_t n = static_cast<int64_t>(shape.size());
  if (n == 0) {
    pwrite_all(fd, data, elem, start, path);
    return;
  }
  const std::vector<int64_t> sizes = block.sizes().vec();
  int64_t k = n - 1; // dims after k are whole: a run spans dims k.. of the piece
  while (k > 0 && sizes[static_cast<size_t>(k)] == shape[static_cast<size_t>(k)]) {
    --k;
  }
  std::vector<int64_t> stride(static_cast<size_t>(n), 1);
  for (int64_t d = n - 2; d >= 0; --d) {
    stride[static_cast<size_t>(d)] =
        stride[static_cast<size_t>(d + 1)] * shape[static_cast<size_t>(d + 1)];
  }
  const int64_t run = sizes[static_cast<size_t>(k)] * stride[static_cast<size_t>(k)] * elem;
  std::vector<int64_t> at(static_cast<size_t>(k), 0); // the run's index over dims < k
  for (int64_t done = 0; done < block.numel() * elem; done += run) {
    int64_t element = offsets[static_cast<size_t>(k)] * stride[static_cast<size_t>(k)];
    for (int64_t d = 0; d < k; ++d) {
      element += (offsets[static_cast<size_t>(d)] + at[static_cast<size_t>(d)]) *
                 stride[static_cast<size_t>(d)];
    }
    pwrite_all(fd, data + done, run, start + element * elem, path);
    for (int64_t d = k - 1; d >= 0; --d) { // the next run
      if (++at[static_cast<size_t>(d)] < sizes[static_cast<size_t>(d)]) {
        break;
      }
      at[static_cast<size_t>(d)] = 0;
    }
  }
}

// The files' open descriptors in the temporary directory, synced and closed at the end.
class OpenFiles {
 public:
  OpenFiles(const Layout& l, fs::path tmp)
      : layout_(&l), tmp_(std::move(tmp)), fds_(l.files.size(), -1) {}
  ~OpenFiles() {
    for (int fd : fds_) {
      if (fd >= 0) {
        ::close(fd);
      }
    }
  }
  int get(size_t f) {
    if (fds_[f] < 0) {
      const std::string p = path(f);
      fds_[f] = ::open(p.c_str(), O_WRONLY | O_CLOEXEC);
      DTENSOR_CHECK(fds_[f] >= 0, "checkpoint: cannot open {}: {}", p, st::errno_text());
    }
    return fds_[f];
  }
  std::string path(size_t f) const { return (tmp_ / layout_->files[f].name).string(); }
  void close_all(bool sync) {
    for (size_t f = 0; f < fds_.size(); ++f) {
      if (fds_[f] < 0) {
        continue;
      }
      const int fd = std::exchange(fds_[f], -1);
      const bool synced = !sync || ::fsync(fd) == 0;
      const std::string why = st::errno_text();
      DTENSOR_CHECK(::close(fd) == 0 && synced, "checkpoint: cannot sync {}: {}", path(f), why);
    }
  }

 private:
  const Layout* layout_;
  fs::path tmp_;
  std::vector<int> fds_;
};

// Rank 0: every file with its header, at its full length.
void create_files(const Layout& l, const fs::path& tmp, bool sync) {
  OpenFiles files(l, tmp);
  for (size_t f = 0; f < l.files.size(); ++f) {
    const std::string p = files.path(f);
    const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    DTENSOR_CHECK(fd >= 0, "checkpoint: cannot create {}: {}", p, st::errno_text());
    ::close(fd);
    const uint64_t n = l.files[f].header.size();
    pwrite_all(files.get(f), reinterpret_cast<const char*>(&n), 8, 0, p);
    pwrite_all(files.get(f), l.files[f].header.data(), static_cast<int64_t>(n), 8, p);
    DTENSOR_CHECK(::ftruncate(files.get(f), static_cast<off_t>(l.files[f].size)) == 0,
                  "checkpoint: cannot extend {} to {} bytes: {}", p, l.files[f].size,
                  st::errno_text());
  }
  files.close_all(sync);
}

// This rank's pieces, each to its place.
void write_own_pieces(const detail::PreparedSave& p, const Layout& l, bool sync) {
  OpenFiles files(l, p.tmp);
  for (const detail::WriteChunk& c : p.plan.chunks[static_cast<size_t>(get_rank())]) {
    const detail::SavedTensor& t = p.tensors[c.tensor];
    const at::Tensor block = detail::chunk_data(t);
    const std::vector<size_t>& entries = l.entries_of[l.tensor_index.at(t.key)];
    for (size_t e : entries) {
      const Entry& entry = l.entries[e];
      const auto [f, start] = l.place[e];
      if (entry.row < 0) {
        write_block(files.get(f), files.path(f), block, entry.item.shape, c.offsets, start);
        continue;
      }
      const int64_t local = entry.row - c.offsets[0]; // the row within this piece, if it is
      if (local < 0 || local >= block.size(0)) {
        continue;
      }
      const std::vector<int64_t> rest(c.offsets.begin() + 1, c.offsets.end());
      write_block(files.get(f), files.path(f), block.select(0, local), entry.item.shape, rest,
                  start);
    }
  }
  files.close_all(sync);
}

// Rank 0: the index (several files), the extra files and the manifest.
void write_folder_files(const Layout& l, const fs::path& tmp, const HfSaveOptions& options) {
  std::vector<std::string> written;
  for (const FilePlan& f : l.files) {
    written.push_back(f.name);
  }
  if (l.files.size() > 1) {
    nlohmann::json weight_map = nlohmann::json::object();
    int64_t total = 0;
    for (size_t e = 0; e < l.entries.size(); ++e) {
      weight_map[l.entries[e].item.key] = l.files[l.place[e].first].name;
      total += bytes_of(l.entries[e].item);
    }
    written.push_back("model.safetensors.index.json");
    detail::write_text_file(
        tmp / written.back(),
        nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2),
        options.fsync());
  }
  for (const auto& [file, content] : options.extra_files()) {
    detail::write_text_file(tmp / file, content, options.fsync());
    written.push_back(file);
  }
  detail::write_manifest(tmp, detail::OutputKind::kHfExport, written, options.fsync());
}

void check_extra_files(const HfSaveOptions& options, const std::string& what) {
  for (const auto& [file, content] : options.extra_files()) {
    const bool weights =
        file.rfind("model", 0) == 0 &&
        (fs::path(file).extension() == ".safetensors" || file == "model.safetensors.index.json");
    DTENSOR_CHECK(!file.empty() && fs::path(file).filename() == file && file != "." &&
                      file != ".." && file != detail::kManifest && !weights,
                  "{}: extra file '{}' is not a plain file name of its own", what, file);
  }
}

} // namespace hf_save
} // namespace

void save_hf(const StateDict& state, const std::string& dir, const HfSaveOptions& options) {
  using namespace hf_save;
  at::NoGradGuard no_grad;
  const Group world = world_group();
  check_extra_files(options, "checkpoint::save_hf(" + dir + ")"); // the same on every rank
  const detail::PreparedSave p =
      detail::prepare_save(state, dir, options.overwrite(), "checkpoint::save_hf");
  const std::string what = p.api + "(" + p.target.name + ")";
  const int rank = get_rank();
  Layout layout;
  const auto discard = [&] { // rank 0: the new files, never published
    if (rank == 0) {
      std::error_code ignored;
      fs::remove_all(p.tmp, ignored);
    }
  };
  const auto step = [&](const std::string& stage, auto&& body) {
    const std::string error = detail::attempt(body);
    try {
      detail::agree_on_errors(what + stage, error, world);
    } catch (...) {
      discard();
      throw;
    }
  };
  step("", [&] {
    layout = plan_files(p.plan, options, what);
    if (rank == 0) {
      create_files(layout, p.tmp, options.fsync());
    }
  });
  step(": writing", [&] { write_own_pieces(p, layout, options.fsync()); });
  step(": publishing", [&] {
    if (rank == 0) {
      write_folder_files(layout, p.tmp, options);
      detail::publish(p.tmp, p.target, options.overwrite(), options.fsync(), "");
    }
  });
}

} // namespace dtensor::checkpoint
