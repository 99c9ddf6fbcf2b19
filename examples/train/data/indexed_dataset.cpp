// Megatron's indexed dataset (data/indexed_dataset.h).
#include "indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace dtensor::train {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kHeader = 9 + 8 + 1 + 8 + 8;

// Megatron's DType codes of the integer dtypes, and their sizes.
int64_t item_size(int code) {
  switch (code) {
  case 1: // uint8
  case 2: // int8
    return 1;
  case 3: // int16
  case 8: // uint16
    return 2;
  case 4: // int32
    return 4;
  case 5: // int64
    return 8;
  default: // 6, 7: float64, float32 (not token ids)
    return 0;
  }
}

// The whole file mapped read-only (nullptr for an empty one).
const unsigned char* map_file(const std::string& path, size_t* bytes) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) {
    throw std::invalid_argument("cannot open " + path + ": " + std::strerror(errno));
  }
  struct stat st {};
  fstat(fd, &st);
  *bytes = static_cast<size_t>(st.st_size);
  void* p = *bytes == 0 ? nullptr : mmap(nullptr, *bytes, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    throw std::invalid_argument("cannot map " + path + ": " + std::strerror(errno));
  }
  return static_cast<const unsigned char*>(p);
}

template <typename T>
T read_at(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

void write_or_throw(std::ofstream& f, const void* data, size_t n, const std::string& path) {
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  if (!f) {
    throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
  }
}

// The write's last bytes reach the file here (a full disk shows now, not as a short file).
void close_or_throw(std::ofstream& f, const std::string& path) {
  f.close();
  if (!f) {
    throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
  }
}

} // namespace

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx = prefix + ".idx";
  const std::string bin = prefix + ".bin";
  idx_ = map_file(idx, &idx_bytes_);
  auto bad = [&](const std::string& why) {
    return std::invalid_argument(idx + ": " + why + " (Megatron's indexed dataset, MMIDIDX)");
  };
  if (idx_bytes_ < kHeader || std::memcmp(idx_, kMagic, 9) != 0) {
    throw bad("not an index file: no MMIDIDX header");
  }
  if (read_at<uint64_t>(idx_ + 9) != 1) {
    throw bad("version " + std::to_string(read_at<uint64_t>(idx_ + 9)) + ", not 1");
  }
  dtype_ = idx_[17];
  item_ = item_size(dtype_);
  if (item_ == 0) {
    throw bad("dtype code " + std::to_string(dtype_) + " is not an integer dtype");
  }
  sequences_ = static_cast<int64_t>(read_at<uint64_t>(idx_ + 18));
  documents_ = static_cast<int64_t>(read_at<uint64_t>(idx_ + 26));
  const size_t need = kHeader + static_cast<size_t>(sequences_) * 12 +
                      static_cast<size_t>(documents_) * 8;
  if (sequences_ < 0 || documents_ < 0 || need > idx_bytes_) {
    throw bad(std::to_string(idx_bytes_) + " bytes cannot hold " + std::to_string(sequences_) +
              " sequences and " + std::to_string(documents_) + " document indices");
  }
  lengths_ = reinterpret_cast<const int32_t*>(idx_ + kHeader);
  pointers_ = reinterpret_cast<const int64_t*>(idx_ + kHeader + 4 * sequences_);
  doc_index_ = reinterpret_cast<const int64_t*>(idx_ + kHeader + 12 * sequences_);
  bin_ = map_file(bin, &bin_bytes_);
  // The sequences tile the .bin in order (preprocess_data.py writes them so): checked at
  // both ends, so that token i is at byte i x item.
  if (sequences_ > 0) {
    const int64_t last = sequences_ - 1;
    const int64_t end = pointers_[last] + static_cast<int64_t>(lengths_[last]) * item_;
    if (pointers_[0] != 0 || end != static_cast<int64_t>(bin_bytes_)) {
      throw std::invalid_argument(bin + ": " + std::to_string(bin_bytes_) +
                                  " bytes, the index's sequences end at byte " +
                                  std::to_string(end) + " from " + std::to_string(pointers_[0]));
    }
  }
  tokens_ = static_cast<int64_t>(bin_bytes_) / item_;
}

IndexedDataset::~IndexedDataset() {
  if (idx_ != nullptr) {
    munmap(const_cast<unsigned char*>(idx_), idx_bytes_);
  }
  if (bin_ != nullptr) {
    munmap(const_cast<unsigned char*>(bin_), bin_bytes_);
  }
}

int64_t IndexedDataset::token_at(int64_t i) const {
  const unsigned char* p = bin_ + i * item_;
  switch (dtype_) {
  case 1:
    return *p;
  case 2:
    return static_cast<int8_t>(*p);
  case 3:
    return read_at<int16_t>(p);
  case 8:
    return read_at<uint16_t>(p);
  case 4:
    return read_at<int32_t>(p);
  default:
    return read_at<int64_t>(p);
  }
}

int64_t IndexedDataset::document_of_sequence(int64_t s) const {
  if (documents_ == 0) {
    return s;
  }
  const int64_t* end = doc_index_ + documents_;
  return std::max<int64_t>(0, std::upper_bound(doc_index_, end, s) - doc_index_ - 1);
}

int64_t IndexedDataset::max_token() const {
  int64_t m = 0;
  for (int64_t i = 0; i < tokens_; ++i) {
    m = std::max(m, token_at(i));
  }
  return m;
}

void IndexedDataset::read(int64_t start, int64_t n, int64_t* tokens, int64_t* docs) const {
  if (start < 0 || n < 0 || start + n > tokens_) {
    throw std::out_of_range(prefix_ + ": tokens [" + std::to_string(start) + ", " +
                            std::to_string(start + n) + ") of " + std::to_string(tokens_));
  }
  // The sequence holding the first token (a binary search over the byte pointers), then on.
  int64_t s = std::upper_bound(pointers_, pointers_ + sequences_, start * item_) - pointers_ - 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = (start + i) * item_;
    while (s + 1 < sequences_ && pointers_[s + 1] <= at) {
      ++s;
    }
    tokens[i] = token_at(start + i);
    docs[i] = document_of_sequence(s);
  }
}

void write_indexed_dataset(const std::string& prefix, const std::vector<std::vector<int64_t>>& docs,
                           int64_t vocab_size) {
  const bool small = vocab_size < 65500; // preprocess_data.py's DType.optimal_dtype
  const uint8_t code = small ? 8 : 4;
  const int64_t item = small ? 2 : 4;
  const std::string bin = prefix + ".bin", idx = prefix + ".idx";
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers;
  std::vector<int64_t> doc_index{0};
  {
    std::ofstream f(bin + ".partial", std::ios::binary | std::ios::trunc);
    int64_t offset = 0;
    for (const auto& d : docs) {
      lengths.push_back(static_cast<int32_t>(d.size()));
      pointers.push_back(offset);
      offset += static_cast<int64_t>(d.size()) * item;
      doc_index.push_back(static_cast<int64_t>(lengths.size()));
      if (small) {
        const std::vector<uint16_t> v(d.begin(), d.end());
        write_or_throw(f, v.data(), v.size() * 2, bin);
      } else {
        const std::vector<int32_t> v(d.begin(), d.end());
        write_or_throw(f, v.data(), v.size() * 4, bin);
      }
    }
    close_or_throw(f, bin);
  }
  {
    std::ofstream f(idx + ".partial", std::ios::binary | std::ios::trunc);
    const uint64_t version = 1, n = lengths.size(), m = doc_index.size();
    write_or_throw(f, kMagic, 9, idx);
    write_or_throw(f, &version, 8, idx);
    write_or_throw(f, &code, 1, idx);
    write_or_throw(f, &n, 8, idx);
    write_or_throw(f, &m, 8, idx);
    write_or_throw(f, lengths.data(), lengths.size() * 4, idx);
    write_or_throw(f, pointers.data(), pointers.size() * 8, idx);
    write_or_throw(f, doc_index.data(), doc_index.size() * 8, idx);
    close_or_throw(f, idx);
  }
  for (const std::string& path : {bin, idx}) { // both written whole: published
    if (std::rename((path + ".partial").c_str(), path.c_str()) != 0) {
      throw std::runtime_error("cannot rename " + path + ".partial: " + std::strerror(errno));
    }
  }
}

} // namespace dtensor::train
