// The recipe's data (recipe_data.h).
#include "recipe_data.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include <ATen/ATen.h>

#include "common.h"
#include "data/hf_tokenizer.h"
#include "tokenizer.h"

namespace dtensor::train {

namespace {

// --data's comma-separated paths.
std::vector<std::string> split_paths(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    if (comma > start) {
      out.push_back(list.substr(start, comma - start));
    }
    start = comma + 1;
  }
  return out;
}

// The first of `names` that the tokenizer.json holds, else an error naming the file.
int64_t special_id(const HfTokenizer& t, const std::string& path,
                   const std::vector<std::string>& names, const char* what) {
  for (const std::string& n : names) {
    if (const auto id = t.token_id(n)) {
      return *id;
    }
  }
  throw std::invalid_argument("--tokenizer " + path + ": no " + what + " token (looked for " +
                              names.front() + " and the like)");
}

// FNV-1a over a row's tokens, then its global index mixed in, kept to 40 bits so that the sum
// over a global batch of up to 2^23 rows fits an int64.
int64_t row_hash(const int64_t* tokens, int64_t n, int64_t global_row) {
  uint64_t h = 1469598103934665603ULL;
  for (int64_t i = 0; i < n; ++i) {
    h = (h ^ static_cast<uint64_t>(tokens[i])) * 1099511628211ULL;
  }
  h ^= static_cast<uint64_t>(global_row) * 0x9E3779B97F4A7C15ULL;
  h *= 1099511628211ULL;
  return static_cast<int64_t>(h >> 24);
}

} // namespace

// [Note: the recipe's vocabulary] --tokenizer FILE: a tokenizer.json (data/hf_tokenizer.h),
// its ids as the `tokenizers` package's, bos / eos its begin / end-of-text tokens; else a
// SentencePiece BPE of --vocab pieces trained at start-up on the training text (every rank the
// same model: one thread, the same input), bos / eos its own.
struct RecipeData::Vocabulary {
  std::optional<HfTokenizer> hf;
  std::unique_ptr<Tokenizer> sp;
  int64_t bos = 0, eos = 0;

  std::vector<int64_t> encode(const std::string& text) const {
    return hf ? hf->encode(text) : sp->encode(text);
  }
};

RecipeData::RecipeData(const Flags& f, int64_t dp_rank, int64_t dp_size)
    : f_(f), dp_rank_(dp_rank), dp_size_(dp_size), vocab_(std::make_unique<Vocabulary>()) {
  if (f.data.empty()) {
    if (!f.tokenizer.empty()) {
      usage("--tokenizer needs --data (the built-in paragraph has its own tokenizer)");
    }
    if (f.val_every > 0) {
      usage("--val-every needs --data (the built-in paragraph holds no held-out documents)");
    }
    vocab_->sp = std::make_unique<Tokenizer>(kCorpus, static_cast<int>(f.vocab));
    paragraph_ = at::tensor(vocab_->sp->encode(kCorpus), at::kLong);
    return;
  }
  DocumentFiles files;
  files.paths = split_paths(f.data);
  files.format = f.data_format;
  std::vector<std::string> docs;
  try {
    docs = read_documents(files);
  } catch (const std::invalid_argument& e) {
    usage(std::string("--data: ") + e.what());
  }
  // Every 20th document held out (the same ones on any mesh); all train under 20 documents.
  std::vector<std::string> train_docs, val_docs;
  for (size_t d = 0; d < docs.size(); ++d) {
    (docs.size() >= 20 && d % 20 == 19 ? val_docs : train_docs).push_back(docs[d]);
  }
  documents_ = static_cast<int64_t>(train_docs.size());
  val_documents_ = static_cast<int64_t>(val_docs.size());
  if (!f.tokenizer.empty()) {
    try {
      vocab_->hf.emplace(f.tokenizer);
    } catch (const std::exception& e) {
      usage(std::string("--tokenizer: ") + e.what());
    }
    vocab_->bos = special_id(*vocab_->hf, f.tokenizer,
                             {"<|begin_of_text|>", "<s>", "<|endoftext|>", "<bos>"}, "begin");
    vocab_->eos = special_id(*vocab_->hf, f.tokenizer,
                             {"<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>"}, "end");
  } else {
    // Trained on an even sample of the documents, about kTrainerBytes of them: the same
    // pieces for a corpus of any size in a few seconds (every rank trains its own copy).
    constexpr size_t kTrainerBytes = 400000;
    size_t total = 0;
    for (const std::string& d : train_docs) {
      total += d.size();
    }
    const size_t stride = std::max<size_t>(1, total / kTrainerBytes);
    std::string text;
    for (size_t d = 0; d < train_docs.size(); d += stride) {
      text += train_docs[d];
    }
    vocab_->sp = std::make_unique<Tokenizer>(text, static_cast<int>(f.vocab));
    vocab_->bos = vocab_->sp->bos();
    vocab_->eos = vocab_->sp->eos();
  }
  auto encode = [this](const std::string& s) { return vocab_->encode(s); };
  train_ = pack(train_docs, encode, vocab_->bos, vocab_->eos);
  val_ = pack(val_docs, encode, vocab_->bos, vocab_->eos);
  try {
    loader_ = std::make_unique<Loader>(train_, f.seq, f.batch, dp_rank, dp_size, f.seed);
  } catch (const std::invalid_argument& e) {
    usage(std::string("--data ") + f.data + ": " + e.what());
  }
  const int64_t val_sequences = num_sequences(val_, f.seq);
  if (f.val_every > 0 && val_sequences < f.batch) {
    usage("--val-every: the held-out documents (every 20th of " + std::to_string(docs.size()) +
          ") hold " + std::to_string(val_sequences) + " sequences of " + std::to_string(f.seq) +
          ", fewer than one --batch of " + std::to_string(f.batch));
  }
  // --val-steps -1 (torchtitan's validation.steps default): every held-out batch.
  const int64_t held_out = val_sequences / f.batch;
  val_batches_ = f.val_every <= 0 ? 0 : f.val_steps < 0 ? held_out : std::min(f.val_steps, held_out);
}

RecipeData::~RecipeData() = default;

int64_t RecipeData::vocab_size() const {
  return vocab_->hf ? vocab_->hf->size() : vocab_->sp->size();
}

std::vector<int64_t> RecipeData::encode(const std::string& text) const {
  return vocab_->encode(text);
}

std::string RecipeData::decode(const std::vector<int64_t>& ids) const {
  return vocab_->hf ? vocab_->hf->decode(ids) : vocab_->sp->decode(ids);
}

std::string RecipeData::describe() const {
  if (!from_files()) {
    return "the built-in paragraph (" + std::to_string(paragraph_.numel()) + " tokens)";
  }
  return std::to_string(documents_) + " documents, " + std::to_string(train_.tokens.size()) +
         " tokens (" + std::to_string(loader_->sequences()) + " sequences) from --data, " +
         std::to_string(val_documents_) + " held out (" + std::to_string(val_.tokens.size()) +
         " tokens); tokenizer: " +
         (vocab_->hf ? f_.tokenizer : "SentencePiece BPE trained on them") + ", " +
         std::to_string(vocab_size()) + " ids";
}

at::Tensor RecipeData::train_rows(int64_t step) {
  const int64_t rows = f_.batch / dp_size_;
  if (loader_) {
    Loader::Batch b = loader_->next();
    return at::tensor(b.tokens, at::kLong).view({rows, f_.seq + 1});
  }
  // Without --data: random windows of the paragraph from the step's seed.
  at::manual_seed(1000 + 31 * step + 1000003 * f_.seed);
  const at::Tensor starts = at::randint(paragraph_.size(0) - f_.seq - 1, {f_.batch}, at::kLong);
  std::vector<at::Tensor> out;
  for (int64_t b = dp_rank_ * rows; b < (dp_rank_ + 1) * rows; ++b) {
    out.push_back(paragraph_.narrow(0, starts[b].item<int64_t>(), f_.seq + 1));
  }
  return at::stack(out);
}

int64_t RecipeData::position() const {
  return loader_ ? loader_->position() : 0;
}

void RecipeData::resume(int64_t position) {
  if (loader_) {
    loader_->resume(position);
  }
}

// Validation batch k: global batch k of the held-out stream in order, this rank's rows.
at::Tensor RecipeData::validation_rows(int64_t k) const {
  const int64_t rows = f_.batch / dp_size_;
  const int64_t first = k * f_.batch + dp_rank_ * rows;
  std::vector<int64_t> ids(val_.tokens.begin() + first * f_.seq,
                           val_.tokens.begin() + (first + rows) * f_.seq + 1);
  at::Tensor flat = at::tensor(ids, at::kLong);
  return flat.as_strided({rows, f_.seq + 1}, {f_.seq, 1}).clone();
}

int64_t RecipeData::digest(const at::Tensor& rows) const {
  const at::Tensor c = rows.contiguous().to(at::kLong);
  const int64_t n = c.size(0), len = c.size(1);
  int64_t sum = 0;
  for (int64_t r = 0; r < n; ++r) {
    sum += row_hash(c.data_ptr<int64_t>() + r * len, len, dp_rank_ * n + r);
  }
  return sum;
}

} // namespace dtensor::train
