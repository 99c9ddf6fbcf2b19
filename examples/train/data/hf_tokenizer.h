#pragma once

// A Hugging Face tokenizer.json of the byte-level BPE family (GPT-2's, Llama 3's, Qwen's) in
// C++, for the recipe's data (docs/recipe.md, "Data"): ids equal to the `tokenizers`
// package's encode(text, add_special_tokens=False) (test/data/tokenizer_judge.py). What it
// reads: added tokens (matched before anything else, longest first), no normalizer, the
// ByteLevel pre-tokenizer (GPT-2's regex or none, add_prefix_space) alone or after Split
// (a regex, Isolated), and the BPE model (merges as "a b" or ["a", "b"], ignore_merges).
// Anything else is refused naming the file and the key.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace dtensor::train {

class HfTokenizer {
 public:
  explicit HfTokenizer(const std::string& tokenizer_json_path);
  ~HfTokenizer();
  HfTokenizer(HfTokenizer&&) noexcept;
  HfTokenizer& operator=(HfTokenizer&&) noexcept;

  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t size() const; // the largest id + 1
  std::optional<int64_t> token_id(const std::string& token) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace dtensor::train
