#pragma once

// The safetensors file format as PyTorch's DCP writes it (HuggingFaceStorageWriter with
// save_distributed): an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the tensors' bytes back to back. DCP adds to
// the header's "__metadata__" the global offsets of each chunk (DCP_SHARDING_INFO, itself a
// JSON string), DCP_VERSION and format "pt". dtensor adds two keys PyTorch ignores:
// dtensor_files (every file the checkpoint consists of) and dtensor_xxh3 (an XXH3-64 hash per tensor).
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtensor::detail::safetensors {

// One tensor (a chunk of a global tensor) in a file.
struct Chunk {
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  std::vector<int64_t> offsets; // in the global tensor (zeros without DCP_SHARDING_INFO)
  int64_t begin = 0;            // absolute byte range in the file
  int64_t end = 0;
  std::optional<uint64_t> hash; // dtensor_xxh3
};

struct FileIndex {
  std::string path;
  int64_t size = 0;
  std::vector<Chunk> chunks;
  std::vector<std::string> listed_files; // dtensor_files, empty for other writers
};

// Reads and checks a file's header: every chunk inside the file, byte ranges consistent
// with dtypes and shapes. Errors name the file (and the key).
FileIndex read_index(const std::string& path);

// What the header says of one tensor to write.
struct Item {
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  std::vector<int64_t> offsets;  // in the global tensor
  std::optional<uint64_t> hash; // written to dtensor_xxh3 when set
};

struct WriteOptions {
  std::vector<std::string> listed_files; // dtensor_files (none when empty)
  bool sharding_info = true;             // DCP_SHARDING_INFO (a consolidated file has none)
  bool fsync = true;
};

// The header's JSON for `items`, padded so that the data start 8-byte aligned (the file is
// its 8-byte little-endian length, this text, then the items' bytes in order). Each item's
// offset from the data's start goes to `item_offsets`, their total to `data_bytes`.
std::string header_text(const std::vector<Item>& items, const WriteOptions& options,
                        std::vector<int64_t>* item_offsets, int64_t* data_bytes);

// strerror(errno), for messages.
std::string errno_text();

// Writes all `bytes` to `fd` (retrying short writes); a failure (a full disk) raises, naming `path`.
void write_all(int fd, const void* data, int64_t bytes, const std::string& path);

// Writes one file: the header, then data(i) for each item in turn (a contiguous CPU tensor
// of the item's shape and dtype, requested only when written, so a caller may build one at
// a time). Created, written, fsynced, closed. Returns the file's size.
int64_t write_file(const std::string& path, const std::vector<Item>& items,
                   const std::function<at::Tensor(size_t)>& data, const WriteOptions& options);

// The file's bytes, mapped read-only for the lifetime of the object.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  // The mapping is read-only: nothing may write through this pointer.
  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

// A chunk's bytes as a tensor viewing the mapping (valid while `file` lives); with `verify`
// its hash is checked when the file has one.
at::Tensor chunk_tensor(const MappedFile& file, const FileIndex& index, const Chunk& chunk,
                        bool verify = true);

const char* dtype_name(c10::ScalarType dtype); // "F32", ...; throws for unsupported dtypes
uint64_t hash_of(const void* data, int64_t bytes); // XXH3-64

} // namespace dtensor::detail::safetensors
