#pragma once

// The recipe's tokenizer: a SentencePiece BPE model (Debian's libsentencepiece) trained at
// start-up on the text, in memory, the same on every rank (one thread: deterministic).
#include <memory>
#include <string>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
} // namespace sentencepiece

namespace dtensor::train {

class Tokenizer {
 public:
  // Trains on `text`, split into sentences at ", " and ". "; `vocab_size` pieces at most.
  Tokenizer(const std::string& text, int vocab_size);
  // Loads a SentencePiece model file (a `.model`: one this class saved, or any other).
  explicit Tokenizer(const std::string& model_path);
  // Writes the model as a SentencePiece `.model` file.
  void save(const std::string& path) const;
  // The `.model` file's bytes.
  std::string serialized() const;
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t size() const;
  int64_t bos() const; // SentencePiece's begin / end-of-sentence ids (1 and 2)
  int64_t eos() const;

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
};

} // namespace dtensor::train
