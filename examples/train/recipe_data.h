#pragma once

// The recipe's data (docs/recipe.md, "Data"). With --data: the files' documents (text with a
// separator line, or JSON lines), every 20th held out for the validation loss, tokenized once
// by --tokenizer (a Hugging Face tokenizer.json) or by a SentencePiece BPE trained on the
// training documents at start-up, packed with bos / eos and document boundaries, handed out
// by the loader of data/text_data.h (its one-number state goes into the checkpoint, so a
// resumed run, on any mesh, continues with the exact next batch). Without --data: the
// built-in paragraph, random windows drawn from a per-step seed.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "data/indexed_dataset.h"
#include "data/text_data.h"
#include "llama_flags.h"

namespace dtensor::train {

class RecipeData {
 public:
  // Reads, tokenizes and packs (the same on every rank). `dp_rank` of `dp_size`: which rows
  // of each global batch this rank loads. Errors name the flag and the file.
  RecipeData(const Flags& f, int64_t dp_rank, int64_t dp_size);
  ~RecipeData();
  RecipeData(const RecipeData&) = delete;
  RecipeData& operator=(const RecipeData&) = delete;

  bool from_files() const { return loader_ != nullptr; }
  int64_t vocab_size() const; // the tokenizer's ids (the model pads it to a multiple of 8)
  int64_t eos_id() const;     // the end-of-text token that closes each packed document
  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  std::string describe() const;
  // The tokenizer as files of a Hugging Face model folder, by name: the tokenizer.json or
  // tokenizer.model it was read from (a SentencePiece model trained here as tokenizer.model),
  // the tokenizer_config.json and special_tokens_map.json beside it, and generation_config.json
  // (the --init-from-hf folder's, else one naming bos and eos).
  std::map<std::string, std::string> hf_files() const;

  // This rank's rows of step `step`'s global batch, [batch / dp_size, seq + 1] int64 on the
  // CPU (inputs: the first seq tokens, targets: the last seq). With files, the loader's next
  // batch (`step` is not used: the loader's position says which batch comes next).
  at::Tensor train_rows(int64_t step);
  // The loader's position (sequences handed out, over all ranks) and its inverse.
  int64_t position() const;
  void resume(int64_t position);
  // The validation batches: `count()` of them, this rank's rows of batch k as train_rows.
  int64_t validation_batches() const { return val_batches_; }
  at::Tensor validation_rows(int64_t k) const;

  // A digest of these rows at their global row indices (this rank's share of the global
  // batch's digest: the sum over the data-parallel ranks identifies the global batch).
  int64_t digest(const at::Tensor& rows) const;

 private:
  struct Vocabulary;
  void load_tokenizer(std::string path, const std::string& what);
  void start_loader(int64_t documents);
  void prepare(const std::vector<std::string>& train_docs, const std::vector<std::string>& val_docs);
  bool open_indexed();
  at::Tensor checked_ids(const at::Tensor& rows) const;

  const Flags& f_;
  int64_t dp_rank_, dp_size_;
  std::unique_ptr<Vocabulary> vocab_;
  at::Tensor paragraph_; // without files: the paragraph's ids
  PackedTokens train_, val_;                      // --data files
  std::unique_ptr<IndexedDataset> train_mm_, val_mm_; // --data FOLDER or PREFIX
  const TokenSource* train_src_ = nullptr;
  const TokenSource* val_src_ = nullptr;
  std::unique_ptr<Loader> loader_;
  int64_t val_batches_ = 0;
  int64_t documents_ = 0, val_documents_ = 0;
};

} // namespace dtensor::train
