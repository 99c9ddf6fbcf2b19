// The safetensors file format (lib/checkpoint/safetensors.h).
#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "internal/check.h"

namespace dtensor::detail::safetensors {

namespace {

using nlohmann::json;

constexpr int64_t kMaxHeader = 100 << 20; // as the safetensors library
const char* const kShardingInfo = "DCP_SHARDING_INFO";
const char* const kFilesKey = "dtensor_files";
const char* const kHashKey = "dtensor_xxh3"; // XXH3-64 of each chunk, as 16 hex digits

const std::vector<std::pair<const char*, c10::ScalarType>>& dtype_table() {
  static const std::vector<std::pair<const char*, c10::ScalarType>> table = {
      {"F64", at::kDouble}, {"F32", at::kFloat},   {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},     {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool},
      {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},
  };
  return table;
}

c10::ScalarType dtype_of(const std::string& name, const std::string& path, const std::string& key) {
  for (const auto& [n, t] : dtype_table()) {
    if (name == n) {
      return t;
    }
  }
  DTENSOR_FAIL("checkpoint: {}: tensor '{}' has dtype '{}', which dtensor does not read", path, key, name);
}


int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    n *= s;
  }
  return n;
}

std::vector<int64_t> int_list(const json& j, const std::string& path, const std::string& key,
                              const char* field) {
  DTENSOR_CHECK(j.is_array(), "checkpoint: {}: tensor '{}': '{}' is not a list", path, key, field);
  std::vector<int64_t> out;
  for (const auto& v : j) {
    DTENSOR_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0,
                  "checkpoint: {}: tensor '{}': '{}' holds {}, not a non-negative integer", path,
                  key, field, v.dump());
    out.push_back(v.get<int64_t>());
  }
  return out;
}

// The header's JSON, read with its length checked against the file's size.
json read_header(int fd, const std::string& path, int64_t file_size, int64_t* data_start) {
  DTENSOR_CHECK(file_size >= 8, "checkpoint: {}: truncated ({} bytes, no header)", path, file_size);
  uint64_t n = 0;
  DTENSOR_CHECK(::pread(fd, &n, 8, 0) == 8, "checkpoint: {}: cannot read: {}", path, errno_text());
  DTENSOR_CHECK(n <= static_cast<uint64_t>(kMaxHeader) && static_cast<int64_t>(n) <= file_size - 8,
                "checkpoint: {}: corrupt or truncated (header of {} bytes in a file of {} bytes)",
                path, n, file_size);
  std::string text(n, '\0');
  DTENSOR_CHECK(::pread(fd, text.data(), n, 8) == static_cast<ssize_t>(n),
                "checkpoint: {}: cannot read the header: {}", path, errno_text());
  *data_start = 8 + static_cast<int64_t>(n);
  json header = json::parse(text, nullptr, /*allow_exceptions=*/false);
  DTENSOR_CHECK(header.is_object(), "checkpoint: {}: corrupt header (not a JSON object)", path);
  return header;
}

json string_metadata(const json& meta, const char* key, const std::string& path) {
  if (!meta.is_object() || !meta.contains(key)) {
    return json();
  }
  DTENSOR_CHECK(meta[key].is_string(), "checkpoint: {}: __metadata__.{} is not a string", path, key);
  json parsed = json::parse(meta[key].get<std::string>(), nullptr, false);
  DTENSOR_CHECK(!parsed.is_discarded(), "checkpoint: {}: __metadata__.{} is not valid JSON", path, key);
  return parsed;
}

Chunk parse_chunk(const std::string& key, const json& entry, const json& sharding, const json& hashes,
                  const std::string& path, int64_t data_start, int64_t file_size) {
  DTENSOR_CHECK(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                    entry.contains("data_offsets") && entry["dtype"].is_string(),
                "checkpoint: {}: tensor '{}' lacks dtype, shape or data_offsets", path, key);
  Chunk c;
  c.key = key;
  c.dtype = dtype_of(entry["dtype"].get<std::string>(), path, key);
  c.shape = int_list(entry["shape"], path, key, "shape");
  const auto range = int_list(entry["data_offsets"], path, key, "data_offsets");
  DTENSOR_CHECK(range.size() == 2 && range[0] <= range[1], "checkpoint: {}: tensor '{}': bad data_offsets",
                path, key);
  c.begin = data_start + range[0];
  c.end = data_start + range[1];
  DTENSOR_CHECK(c.end <= file_size,
                "checkpoint: {}: truncated: tensor '{}' ends at byte {} but the file has {}", path,
                key, c.end, file_size);
  const int64_t want = numel_of(c.shape) * static_cast<int64_t>(c10::elementSize(c.dtype));
  DTENSOR_CHECK(c.end - c.begin == want,
                "checkpoint: {}: tensor '{}' holds {} bytes but its shape {} of {} needs {}", path,
                key, c.end - c.begin, c.shape, c10::toString(c.dtype), want);
  c.offsets.assign(c.shape.size(), 0);
  if (!sharding.is_null()) {
    DTENSOR_CHECK(sharding.contains(key) && sharding[key].contains("saved_offsets"),
                  "checkpoint: {}: tensor '{}' has no saved_offsets in DCP_SHARDING_INFO", path, key);
    c.offsets = int_list(sharding[key]["saved_offsets"], path, key, "saved_offsets");
    DTENSOR_CHECK(c.offsets.size() == c.shape.size(),
                  "checkpoint: {}: tensor '{}': saved_offsets {} do not match shape {}", path, key,
                  c.offsets, c.shape);
  }
  if (!hashes.is_null() && hashes.contains(key)) {
    DTENSOR_CHECK(hashes[key].is_string(), "checkpoint: {}: tensor '{}': bad {}", path, key, kHashKey);
    c.hash = std::stoull(hashes[key].get<std::string>(), nullptr, 16);
  }
  return c;
}

} // namespace

std::string errno_text() { return std::strerror(errno); }

void write_all(int fd, const void* data, int64_t bytes, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, static_cast<size_t>(std::min<int64_t>(bytes, 1 << 30)));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    DTENSOR_CHECK(n > 0, "checkpoint: cannot write {}: {}", path, errno_text());
    p += n;
    bytes -= n;
  }
}

const char* dtype_name(c10::ScalarType dtype) {
  for (const auto& [n, t] : dtype_table()) {
    if (t == dtype) {
      return n;
    }
  }
  DTENSOR_FAIL("checkpoint: dtype {} has no safetensors name", c10::toString(dtype));
}

uint64_t hash_of(const void* data, int64_t bytes) {
  return XXH3_64bits(data, static_cast<size_t>(bytes));
}

FileIndex read_index(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DTENSOR_CHECK(fd >= 0, "checkpoint: cannot open {}: {}", path, errno_text());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  DTENSOR_CHECK(::fstat(fd, &st) == 0, "checkpoint: cannot stat {}: {}", path, errno_text());
  FileIndex index;
  index.path = path;
  index.size = st.st_size;
  int64_t data_start = 0;
  const json header = read_header(fd, path, index.size, &data_start);
  const json meta = header.contains("__metadata__") ? header["__metadata__"] : json();
  const json sharding = string_metadata(meta, kShardingInfo, path);
  const json hashes = string_metadata(meta, kHashKey, path);
  const json files = string_metadata(meta, kFilesKey, path);
  if (files.is_array()) {
    for (const auto& f : files) {
      index.listed_files.push_back(f.get<std::string>());
    }
  }
  int64_t data_end = data_start;
  for (const auto& [key, entry] : header.items()) {
    if (key != "__metadata__") {
      index.chunks.push_back(parse_chunk(key, entry, sharding, hashes, path, data_start, index.size));
      data_end = std::max(data_end, index.chunks.back().end);
    }
  }
  DTENSOR_CHECK(data_end == index.size,
                "checkpoint: {}: {} bytes but its header describes {} (truncated or appended to)",
                path, index.size, data_end);
  return index;
}

std::string header_text(const std::vector<Item>& items, const WriteOptions& options,
                        std::vector<int64_t>* item_offsets, int64_t* data_bytes) {
  json header = json::object();
  json sharding = json::object();
  json hashes = json::object();
  int64_t offset = 0;
  for (const Item& item : items) {
    const int64_t bytes = numel_of(item.shape) * static_cast<int64_t>(c10::elementSize(item.dtype));
    header[item.key] = {{"dtype", dtype_name(item.dtype)},
                        {"shape", item.shape},
                        {"data_offsets", {offset, offset + bytes}}};
    sharding[item.key] = {{"saved_offsets", item.offsets}};
    if (item.hash) {
      hashes[item.key] = fmt::format("{:016x}", *item.hash);
    }
    if (item_offsets != nullptr) {
      item_offsets->push_back(offset);
    }
    offset += bytes;
  }
  json meta = {{"format", "pt"}};
  if (options.sharding_info) {
    meta[kShardingInfo] = sharding.dump();
    meta["DCP_VERSION"] = "1.0";
  }
  if (!options.listed_files.empty()) {
    meta[kFilesKey] = json(options.listed_files).dump();
  }
  if (!hashes.empty()) {
    meta[kHashKey] = hashes.dump();
  }
  header["__metadata__"] = meta;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' '); // the data starts 8-byte aligned
  if (data_bytes != nullptr) {
    *data_bytes = offset;
  }
  return text;
}

int64_t write_file(const std::string& path, const std::vector<Item>& items,
                   const std::function<at::Tensor(size_t)>& data, const WriteOptions& options) {
  int64_t offset = 0;
  const std::string text = header_text(items, options, nullptr, &offset);
  const uint64_t n = text.size();

  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DTENSOR_CHECK(fd >= 0, "checkpoint: cannot create {}: {}", path, errno_text());
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) {
        ::close(fd);
      }
    }
  } closer{fd};
  write_all(fd, &n, 8, path);
  write_all(fd, text.data(), static_cast<int64_t>(n), path);
  for (size_t i = 0; i < items.size(); ++i) {
    const at::Tensor t = data(i);
    DTENSOR_CHECK(t.is_contiguous() && t.device().is_cpu() && t.scalar_type() == items[i].dtype &&
                      t.sizes().vec() == items[i].shape,
                  "checkpoint: internal: data for '{}' does not match its header", items[i].key);
    write_all(fd, t.data_ptr(), static_cast<int64_t>(t.nbytes()), path);
  }
  DTENSOR_CHECK(!options.fsync || ::fsync(fd) == 0, "checkpoint: cannot sync {}: {}", path, errno_text());
  closer.fd = -1;
  DTENSOR_CHECK(::close(fd) == 0, "checkpoint: cannot close {}: {}", path, errno_text());
  return 8 + static_cast<int64_t>(n) + offset;
}

MappedFile::MappedFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DTENSOR_CHECK(fd >= 0, "checkpoint: cannot open {}: {}", path, errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    DTENSOR_FAIL("checkpoint: cannot stat {}: {}", path, errno_text());
  }
  size_ = st.st_size;
  if (size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    DTENSOR_CHECK(p != MAP_FAILED, "checkpoint: cannot map {}: {}", path, errno_text());
    data_ = static_cast<uint8_t*>(p);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) {
    ::munmap(data_, static_cast<size_t>(size_));
  }
}

at::Tensor chunk_tensor(const MappedFile& file, const FileIndex& index, const Chunk& chunk, bool verify) {
  DTENSOR_CHECK(file.size() == index.size, "checkpoint: {} changed size while being read", index.path);
  uint8_t* p = file.data() + chunk.begin;
  // Page tables filled in one call rather than a fault per page (ignored where unsupported).
  const auto page = static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  const int64_t start = chunk.begin / page * page;
  if (chunk.end > start) {
    (void)::madvise(file.data() + start, static_cast<size_t>(chunk.end - start), MADV_POPULATE_READ);
  }
  if (verify && chunk.hash) {
    const uint64_t got = hash_of(p, chunk.end - chunk.begin);
    DTENSOR_CHECK(got == *chunk.hash,
                  "checkpoint: {}: tensor '{}' is corrupt (xxh3 {:016x}, written {:016x})", index.path,
                  chunk.key, got, *chunk.hash);
  }
  // Only ever read from (copied into the targets): the mapping is read-only.
  return at::from_blob(p, chunk.shape, at::TensorOptions().dtype(chunk.dtype));
}

} // namespace dtensor::detail::safetensors
