// The recipe's text data (text_data.h).
#include "text_data.h"

#include <algorithm>
#include <fstream>
#include <random>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace dtensor::train {

namespace {

[[noreturn]] void bad_file(const std::string& path, int64_t line, const std::string& why) {
  throw std::invalid_argument(path + (line > 0 ? ":" + std::to_string(line) : "") + ": " + why);
}

void read_text(const std::string& path, const std::string& separator,
               std::vector<std::string>& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    bad_file(path, 0, "cannot be read");
  }
  std::string line, doc;
  auto flush = [&] {
    if (doc.find_first_not_of(" \t\r\n") != std::string::npos) {
      out.push_back(doc);
    }
    doc.clear();
  };
  while (std::getline(in, line)) {
    if (!separator.empty() && line == separator) {
      flush();
      continue;
    }
    doc += line + "\n";
  }
  flush();
}

void read_jsonl(const std::string& path, const std::string& field, std::vector<std::string>& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    bad_file(path, 0, "cannot be read");
  }
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      continue;
    }
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      bad_file(path, n, std::string("not JSON: ") + e.what());
    }
    if (!j.is_object() || !j.contains(field) || !j[field].is_string()) {
      bad_file(path, n, "not an object with a string \"" + field + "\"");
    }
    if (!j[field].get<std::string>().empty()) {
      out.push_back(j[field].get<std::string>());
    }
  }
}

} // namespace

std::vector<std::string> read_documents(const DocumentFiles& files) {
  if (files.format != "text" && files.format != "jsonl") {
    throw std::invalid_argument("data format '" + files.format + "': text or jsonl");
  }
  std::vector<std::string> out;
  for (const std::string& path : files.paths) {
    if (files.format == "text") {
      read_text(path, files.separator, out);
    } else {
      read_jsonl(path, files.field, out);
    }
  }
  return out;
}

PackedTokens pack(const std::vector<std::string>& docs,
                  const std::function<std::vector<int64_t>(const std::string&)>& encode,
                  int64_t bos, int64_t eos) {
  PackedTokens p;
  for (size_t d = 0; d < docs.size(); ++d) {
    std::vector<int64_t> ids = encode(docs[d]);
    ids.insert(ids.begin(), bos);
    ids.push_back(eos);
    p.tokens.insert(p.tokens.end(), ids.begin(), ids.end());
    p.doc_of.insert(p.doc_of.end(), ids.size(), static_cast<int64_t>(d));
  }
  return p;
}

void PackedTokens::read(int64_t start, int64_t n, int64_t* out, int64_t* docs) const {
  std::copy_n(tokens.begin() + start, n, out);
  std::copy_n(doc_of.begin() + start, n, docs);
}

int64_t num_sequences(const TokenSource& p, int64_t seq) {
  const int64_t n = p.size();
  return n > seq ? (n - 1) / seq : 0;
}

Loader::Loader(const TokenSource& data, int64_t seq, int64_t global_batch, int64_t dp_rank,
               int64_t dp_size, uint64_t seed)
    : data_(data), seq_(seq), batch_(global_batch), rank_(dp_rank), size_(dp_size),
      count_(num_sequences(data, seq)), seed_(seed) {
  if (dp_size < 1 || global_batch % dp_size != 0) {
    throw std::invalid_argument("the global batch " + std::to_string(global_batch) +
                                " does not split over " + std::to_string(dp_size) +
                                " data-parallel ranks");
  }
  if (count_ < 1) {
    throw std::invalid_argument("the data holds " + std::to_string(data.size()) +
                                " tokens: not one sequence of " + std::to_string(seq) + " + 1");
  }
}

// Epoch e's permutation: Fisher-Yates with a 64-bit Mersenne twister seeded by (seed, e), so
// every rank and every platform draws the same order.
int64_t Loader::sequence_at(int64_t position) {
  const int64_t epoch = position / count_;
  if (epoch != epoch_) {
    order_.resize(static_cast<size_t>(count_));
    for (int64_t i = 0; i < count_; ++i) {
      order_[static_cast<size_t>(i)] = i;
    }
    std::mt19937_64 rng(seed_ * 1000003ULL + static_cast<uint64_t>(epoch));
    for (int64_t i = count_ - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
      std::swap(order_[static_cast<size_t>(i)], order_[static_cast<size_t>(j)]);
    }
    epoch_ = epoch;
  }
  return order_[static_cast<size_t>(position % count_)];
}

Loader::Batch Loader::next() {
  Batch b;
  const int64_t rows = batch_ / size_;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = sequence_at(position_ + rank_ * rows + r);
    const size_t at = b.tokens.size();
    b.tokens.resize(at + static_cast<size_t>(seq_ + 1));
    b.docs.resize(at + static_cast<size_t>(seq_ + 1));
    data_.read(s * seq_, seq_ + 1, b.tokens.data() + at, b.docs.data() + at);
    b.sequence_ids.push_back(s);
  }
  position_ += batch_;
  return b;
}

} // namespace dtensor::train
