#pragma once

// The recipe's text data (docs/recipe.md, "Data"): documents read from files, tokenized once,
// packed into one stream with document boundaries, cut into sequences, and handed out as
// global batches split over the data-parallel ranks, with a loader state that resumes at the
// exact next sequence on any mesh. Free of LibTorch: token ids as int64 vectors.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtensor::train {

// Where documents come from: plain text files whose documents are separated by a line that
// is exactly `separator` (fortune's "%"; empty: one document per file), or JSON lines files
// whose objects hold the document under `field`.
struct DocumentFiles {
  std::vector<std::string> paths;
  std::string format = "text"; // "text" or "jsonl"
  std::string separator = "%";
  std::string field = "text";
};

// Every non-empty document of the files, in file order; an unreadable file, a line that is
// not a JSON object with a string `field`, are errors naming the file and the line.
std::vector<std::string> read_documents(const DocumentFiles& files);

// A stream of tokens with the document each belongs to: packed in memory (PackedTokens) or
// memory-mapped from a Megatron indexed dataset (data/indexed_dataset.h).
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual int64_t size() const = 0;
  // Tokens [start, start + n), and the document of each.
  virtual void read(int64_t start, int64_t n, int64_t* tokens, int64_t* docs) const = 0;
};

// The documents' tokens one after another, each document as bos, its tokens, eos.
// `doc_of[i]`: the index of the document token i belongs to (CP's document masks).
struct PackedTokens : TokenSource {
  std::vector<int64_t> tokens;
  std::vector<int64_t> doc_of;

  int64_t size() const override { return static_cast<int64_t>(tokens.size()); }
  void read(int64_t start, int64_t n, int64_t* out, int64_t* docs) const override;
};
PackedTokens pack(const std::vector<std::string>& docs,
                  const std::function<std::vector<int64_t>(const std::string&)>& encode,
                  int64_t bos, int64_t eos);

// Sequence i of length `seq`: tokens [i*seq, i*seq + seq + 1) of the stream (inputs, and the
// targets one token on); as many as fit.
int64_t num_sequences(const TokenSource& p, int64_t seq);

// [Note: the loader's state] The loader hands out sequences in a global order: epoch e is a
// permutation of all sequences (seeded by seed and e). A step takes the next global_batch of
// that order; data-parallel rank r of D gets rows [r B/D, (r+1) B/D) of it. The state is one
// number, the global position of the next sequence, the same on every rank: a loader resumed
// from it on another mesh (another D) hands out the same global batches.
class Loader {
 public:
  // `data` is read, not copied: it must outlive the loader.
  Loader(const TokenSource& data, int64_t seq, int64_t global_batch, int64_t dp_rank,
         int64_t dp_size, uint64_t seed);

  // This rank's rows of the next global batch: B/D sequences of seq + 1 tokens, row-major;
  // with the documents each token belongs to.
  struct Batch {
    std::vector<int64_t> tokens;
    std::vector<int64_t> docs;
    std::vector<int64_t> sequence_ids; // which sequences these rows are (for tests)
  };
  Batch next();

  int64_t position() const { return position_; } // sequences handed out, over all ranks
  void resume(int64_t position) { position_ = position; }
  int64_t sequences() const { return count_; }

 private:
  int64_t sequence_at(int64_t position);

  const TokenSource& data_;
  int64_t seq_, batch_, rank_, size_, count_;
  uint64_t seed_;
  int64_t position_ = 0;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;
};

} // namespace dtensor::train
