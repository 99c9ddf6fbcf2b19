// The recipe's data (recipe_data.h).
#include "recipe_data.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>

#include "common.h"
#include "data/hf_tokenizer.h"
#include "data/indexed_dataset.h"
#include "tokenizer.h"

namespace dtensor::train {

namespace {

// --data's comma-separated paths; a folder stands for its files in name order (for jsonl those
// ending .json / .jsonl, as a Hugging Face dataset folder holds them; hidden files skipped).
std::vector<std::string> split_paths(const std::string& list, const std::string& format) {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string path = list.substr(start, comma - start);
    start = comma + 1;
    if (path.empty()) {
      continue;
    }
    if (!fs::is_directory(path)) {
      out.push_back(path);
      continue;
    }
    std::vector<std::string> files;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(path, ec)) {
      const std::string name = e.path().filename().string();
      const std::string ext = e.path().extension().string();
      if (e.is_regular_file() && name[0] != '.' &&
          (format != "jsonl" || ext == ".json" || ext == ".jsonl")) {
        files.push_back(e.path().string());
      }
    }
    if (ec) {
      usage("--data " + path + ": cannot list the folder: " + ec.message());
    }
    if (files.empty()) {
      usage("--data " + path + ": a folder without " +
            (format == "jsonl" ? "a .json / .jsonl file" : "a file"));
    }
    std::sort(files.begin(), files.end());
    out.insert(out.end(), files.begin(), files.end());
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

// Whether `dir` is a folder holding a tokenizer.json or tokenizer.model.
bool has_tokenizer(const std::string& dir) {
  namespace fs = std::filesystem;
  return !dir.empty() && fs::is_directory(dir) &&
         (fs::exists(fs::path(dir) / "tokenizer.json") ||
          fs::exists(fs::path(dir) / "tokenizer.model"));
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("cannot read " + path);
  }
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

} // namespace

// [Note: the recipe's vocabulary] --tokenizer FILE: a tokenizer.json (data/hf_tokenizer.h),
// its ids as the `tokenizers` package's, bos / eos its begin / end-of-text tokens; else a
// SentencePiece BPE of --vocab pieces trained at start-up on the training text (every rank the
// same model: one thread, the same input), bos / eos its own.
struct RecipeData::Vocabulary {
  std::optional<HfTokenizer> hf;
  std::unique_ptr<Tokenizer> sp;
  std::string path; // the file it was read from, if one
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
  if (open_indexed()) {
    return;
  }
  DocumentFiles files;
  files.paths = split_paths(f.data, f.data_format);
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
    load_tokenizer(f.tokenizer, "--tokenizer");
  } else if (has_tokenizer(f.init_from_hf)) { // a Hugging Face model's own
    load_tokenizer(f.init_from_hf, "--init-from-hf");
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
  if (!f.prepare.empty()) {
    prepare(train_docs, val_docs);
    return;
  }
  auto encode = [this](const std::string& s) { return vocab_->encode(s); };
  train_ = pack(train_docs, encode, vocab_->bos, vocab_->eos);
  val_ = pack(val_docs, encode, vocab_->bos, vocab_->eos);
  train_src_ = &train_;
  val_src_ = &val_;
  start_loader(static_cast<int64_t>(docs.size()));
}

// --tokenizer / a prepared folder's: a tokenizer.json, a SentencePiece .model, or a folder
// holding one of them (a Hugging Face folder, torchtitan's model.hf_assets_path).
void RecipeData::load_tokenizer(std::string path, const std::string& what) {
  namespace fs = std::filesystem;
  if (fs::is_directory(path)) {
    const fs::path dir(path);
    if (!fs::exists(dir / "tokenizer.json") && !fs::exists(dir / "tokenizer.model")) {
      usage(what + " " + path + ": a folder without tokenizer.json or tokenizer.model");
    }
    path = (dir / (fs::exists(dir / "tokenizer.json") ? "tokenizer.json" : "tokenizer.model"))
               .string();
  }
  vocab_->path = path;
  const bool sentencepiece = path.size() > 6 && path.substr(path.size() - 6) == ".model";
  try {
    if (sentencepiece) {
      vocab_->sp = std::make_unique<Tokenizer>(path);
      vocab_->bos = vocab_->sp->bos();
      vocab_->eos = vocab_->sp->eos();
      return;
    }
    vocab_->hf.emplace(path);
  } catch (const std::exception& e) {
    usage(what + ": " + e.what());
  }
  vocab_->bos = special_id(*vocab_->hf, path,
                           {"<|begin_of_text|>", "<s>", "<|endoftext|>", "<bos>"}, "begin");
  vocab_->eos = special_id(*vocab_->hf, path,
                           {"<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>"}, "end");
}

// The loader over train_src_, and the validation batches of val_src_ (`documents`: the
// documents read, for the error).
void RecipeData::start_loader(int64_t documents) {
  try {
    loader_ = std::make_unique<Loader>(*train_src_, f_.seq, f_.batch, dp_rank_, dp_size_, f_.seed);
  } catch (const std::invalid_argument& e) {
    usage(std::string("--data ") + f_.data + ": " + e.what());
  }
  const int64_t val_sequences = val_src_ ? num_sequences(*val_src_, f_.seq) : 0;
  if (f_.val_every > 0 && val_sequences < f_.batch) {
    usage("--val-every: the held-out documents (every 20th of " + std::to_string(documents) +
          ") hold " + std::to_string(val_sequences) + " sequences of " + std::to_string(f_.seq) +
          ", fewer than one --batch of " + std::to_string(f_.batch));
  }
  // --val-steps -1 (torchtitan's validation.steps default): every held-out batch.
  const int64_t held_out = val_sequences / f_.batch;
  val_batches_ = f_.val_every <= 0   ? 0
                 : f_.val_steps < 0 ? held_out
                                    : std::min(f_.val_steps, held_out);
}

// [Note: prepared data] --prepare DIR: the documents tokenized once, each as bos, its tokens,
// eos (the stream the in-memory loader packs, so the same global batches), written as
// Megatron indexed datasets DIR/train and DIR/val, with the tokenizer beside them
// (tokenizer.model, or a copy of --tokenizer's tokenizer.json). Nothing is trained. DIR must
// not exist yet (or be an empty folder): nothing of the user's is replaced. Everything is
// written into DIR.partial, renamed to DIR when complete: a failed run leaves no DIR.
void RecipeData::prepare(const std::vector<std::string>& train_docs,
                         const std::vector<std::string>& val_docs) {
  namespace fs = std::filesystem;
  const fs::path target(f_.prepare);
  const fs::path dir(f_.prepare + ".partial");
  std::error_code ec;
  if (fs::exists(target) && !(fs::is_directory(target) && fs::is_empty(target))) {
    usage("--prepare " + f_.prepare + " exists and is not an empty folder: prepare into a new one");
  }
  if (fs::exists(dir)) {
    usage("--prepare: " + dir.string() + " exists (an interrupted run's?): remove it first");
  }
  fs::create_directories(dir, ec);
  if (ec) {
    usage("--prepare " + f_.prepare + ": " + ec.message());
  }
  for (const auto& [name, docs] : {std::pair{"train", &train_docs}, {"val", &val_docs}}) {
    std::vector<std::vector<int64_t>> ids;
    for (const std::string& d : *docs) {
      std::vector<int64_t> v = vocab_->encode(d);
      v.insert(v.begin(), vocab_->bos);
      v.push_back(vocab_->eos);
      ids.push_back(std::move(v));
    }
    write_indexed_dataset((dir / name).string(), ids, vocab_size());
  }
  if (vocab_->sp) {
    vocab_->sp->save((dir / "tokenizer.model").string());
  } else {
    fs::copy_file(vocab_->path, dir / "tokenizer.json");
  }
  fs::rename(dir, target, ec); // replaces an empty folder only
  if (ec) {
    usage("--prepare: cannot rename " + dir.string() + " to " + f_.prepare + ": " + ec.message());
  }
  documents_ = static_cast<int64_t>(train_docs.size());
  val_documents_ = static_cast<int64_t>(val_docs.size());
}

// --data FOLDER (what --prepare wrote) or PREFIX (a Megatron indexed dataset): memory-mapped,
// nothing read until a batch needs it; the tokenizer from --tokenizer, else the folder's.
bool RecipeData::open_indexed() {
  namespace fs = std::filesystem;
  const bool folder = fs::is_directory(f_.data) && fs::exists(fs::path(f_.data) / "train.idx");
  if (!folder && !fs::exists(f_.data + ".idx")) {
    return false;
  }
  const fs::path dir(f_.data);
  if (f_.tokenizer.empty() && !folder) {
    usage("--data " + f_.data + " is a Megatron indexed dataset: give its --tokenizer "
          "(a tokenizer.json or a SentencePiece .model)");
  }
  // A prepared folder's own tokenizer unless --tokenizer says otherwise (load_tokenizer finds
  // it in the folder).
  if (f_.tokenizer.empty()) {
    load_tokenizer(f_.data, "--data");
  } else {
    load_tokenizer(f_.tokenizer, "--tokenizer");
  }
  try {
    train_mm_ = std::make_unique<IndexedDataset>(folder ? (dir / "train").string() : f_.data);
    if (folder && fs::exists(dir / "val.idx")) {
      val_mm_ = std::make_unique<IndexedDataset>((dir / "val").string());
    }
  } catch (const std::exception& e) {
    usage(std::string("--data: ") + e.what());
  }
  train_src_ = train_mm_.get();
  val_src_ = val_mm_.get();
  documents_ = train_mm_->document_count();
  val_documents_ = val_mm_ ? val_mm_->document_count() : 0;
  start_loader(documents_ + val_documents_);
  return true;
}

std::map<std::string, std::string> RecipeData::hf_files() const {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> files;
  if (!vocab_->path.empty()) {
    const fs::path path(vocab_->path);
    files[vocab_->sp ? "tokenizer.model" : "tokenizer.json"] = file_bytes(path.string());
    for (const char* beside : {"tokenizer_config.json", "special_tokens_map.json"}) {
      if (fs::exists(path.parent_path() / beside)) {
        files[beside] = file_bytes((path.parent_path() / beside).string());
      }
    }
  } else {
    files["tokenizer.model"] = vocab_->sp->serialized();
  }
  const fs::path generation = fs::path(f_.init_from_hf) / "generation_config.json";
  if (!f_.init_from_hf.empty() && fs::exists(generation)) {
    files["generation_config.json"] = file_bytes(generation.string());
  } else {
    const int64_t bos = vocab_->sp ? vocab_->sp->bos() : vocab_->bos;
    const int64_t eos = vocab_->sp ? vocab_->sp->eos() : vocab_->eos;
    files["generation_config.json"] = "{\n  \"_from_model_config\": true,\n  \"bos_token_id\": " +
                                      std::to_string(bos) + ",\n  \"eos_token_id\": " +
                                      std::to_string(eos) + "\n}\n";
  }
  return files;
}

RecipeData::~RecipeData() = default;

int64_t RecipeData::eos_id() const {
  return vocab_->eos;
}

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
  return std::to_string(documents_) + " documents, " + std::to_string(train_src_->size()) +
         " tokens (" + std::to_string(loader_->sequences()) + " sequences) from --data" +
         (train_mm_ ? " (memory-mapped)" : "") + ", " + std::to_string(val_documents_) +
         " held out (" + std::to_string(val_src_ ? val_src_->size() : 0) +
         " tokens); tokenizer: " +
         (vocab_->hf                       ? vocab_->path
          : train_mm_ || !f_.tokenizer.empty() ? "SentencePiece model"
                                            : "SentencePiece BPE trained on them") +
         ", " + std::to_string(vocab_size()) + " ids";
}

at::Tensor RecipeData::train_rows(int64_t step) {
  const int64_t rows = f_.batch / dp_size_;
  if (loader_) {
    Loader::Batch b = loader_->next();
    return checked_ids(at::tensor(b.tokens, at::kLong).view({rows, f_.seq + 1}));
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

// A memory-mapped dataset's ids are read as they are: one outside the tokenizer's vocabulary
// (a file tokenized by another tokenizer) is an error naming the file, before the model sees
// it. The rows this rank reads only: the file is never read whole.
at::Tensor RecipeData::checked_ids(const at::Tensor& rows) const {
  if (train_mm_ && rows.numel() > 0) {
    const int64_t low = rows.min().item<int64_t>(), high = rows.max().item<int64_t>();
    if (low < 0 || high >= vocab_size()) {
      throw std::invalid_argument("--data " + f_.data + ": token id " +
                                  std::to_string(low < 0 ? low : high) + " is outside the " +
                                  "tokenizer's " + std::to_string(vocab_size()) + " ids");
    }
  }
  return rows;
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
  const int64_t n = rows * f_.seq + 1;
  std::vector<int64_t> ids(static_cast<size_t>(n)), docs(static_cast<size_t>(n));
  val_src_->read(first * f_.seq, n, ids.data(), docs.data());
  at::Tensor flat = at::tensor(ids, at::kLong);
  return checked_ids(flat.as_strided({rows, f_.seq + 1}, {f_.seq, 1}).clone());
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
