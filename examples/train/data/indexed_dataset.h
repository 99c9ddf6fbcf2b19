#pragma once

// Megatron's indexed dataset (megatron/core/datasets/indexed_dataset.py, the "MMIDIDX" format
// its preprocess_data.py writes), memory-mapped: training data tokenized once, read by every
// rank without loading it. PREFIX.bin holds the tokens of every sequence one after another
// (one dtype: uint8, int8, int16, int32, int64, uint16 and the like); PREFIX.idx holds the
// header (9 bytes "MMIDIDX\0\0", u64 version 1, u8 dtype code, u64 sequence count, u64
// document-index count), then int32 sequence lengths, int64 byte pointers into the .bin, and
// int64 document indices (the first sequence of each document, then the sequence count).
// Free of LibTorch, as data/text_data.h.
#include <cstdint>
#include <string>
#include <vector>

#include "text_data.h"

namespace dtensor::train {

class IndexedDataset : public TokenSource {
 public:
  // Maps PREFIX.idx and PREFIX.bin; a missing file, a bad header, a dtype that is not an
  // integer, or pointers that do not tile the .bin are errors naming the file.
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset() override;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  int64_t size() const override { return tokens_; }
  int64_t sequence_count() const { return sequences_; }
  int64_t document_count() const { return documents_ > 0 ? documents_ - 1 : 0; }
  int64_t max_token() const; // the largest token id (reads every token: for checks)
  // Tokens [start, start + n) of the stream, and the document of each.
  void read(int64_t start, int64_t n, int64_t* tokens, int64_t* docs) const override;

 private:
  int64_t token_at(int64_t i) const;
  int64_t document_of_sequence(int64_t s) const;

  std::string prefix_;
  const unsigned char* idx_ = nullptr;
  const unsigned char* bin_ = nullptr;
  size_t idx_bytes_ = 0, bin_bytes_ = 0;
  int dtype_ = 0;
  int64_t item_ = 0; // bytes per token
  int64_t sequences_ = 0, documents_ = 0, tokens_ = 0;
  const int32_t* lengths_ = nullptr;
  const int64_t* pointers_ = nullptr;
  const int64_t* doc_index_ = nullptr;
};

// Writes `docs` (token ids) as PREFIX.bin / PREFIX.idx, one sequence per document, tokens as
// uint16 when every id of a `vocab_size` vocabulary fits, else int32 (preprocess_data.py's
// choice). Both files are written beside their names and renamed into place.
void write_indexed_dataset(const std::string& prefix, const std::vector<std::vector<int64_t>>& docs,
                           int64_t vocab_size);

} // namespace dtensor::train
