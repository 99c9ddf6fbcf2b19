// One job of test/data/data_judge.py: examples/train's text data (text_data.h) on files the
// judge wrote, tokenized with a tokenizer.json (hf_tokenizer.h). Prints one JSON object:
// the documents, the packed stream (tokens and their documents), the sequence count, and for
// each data-parallel size D in 1, 2, 4 every rank's batches over STEPS steps (sequence ids and
// tokens), and a run on D = 4 stopped after RESUME steps whose position resumes on D = 2.
//
//   data_worker TOKENIZER_JSON FORMAT FILE SEQ BATCH STEPS RESUME
#include <cstdio>
#include <iostream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "hf_tokenizer.h"
#include "text_data.h"

using dtensor::train::Loader;

namespace {

nlohmann::json batches(const dtensor::train::PackedTokens& p, int64_t seq, int64_t batch,
                       int64_t dp, int64_t from, int64_t steps) {
  nlohmann::json ranks = nlohmann::json::array();
  for (int64_t r = 0; r < dp; ++r) {
    Loader loader(p, seq, batch, r, dp, 7);
    loader.resume(from);
    nlohmann::json out = nlohmann::json::array();
    for (int64_t s = 0; s < steps; ++s) {
      const Loader::Batch b = loader.next();
      out.push_back({{"ids", b.sequence_ids}, {"tokens", b.tokens}, {"docs", b.docs}});
    }
    ranks.push_back(out);
  }
  return ranks;
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: data_worker TOKENIZER_JSON FORMAT FILE SEQ BATCH STEPS RESUME\n");
    return 2;
  }
  try {
    const dtensor::train::HfTokenizer tok(argv[1]);
    dtensor::train::DocumentFiles files;
    files.format = argv[2];
    files.paths = {argv[3]};
    const int64_t seq = std::stoll(argv[4]), batch = std::stoll(argv[5]);
    const int64_t steps = std::stoll(argv[6]), resume = std::stoll(argv[7]);
    const std::vector<std::string> docs = dtensor::train::read_documents(files);
    const auto packed = dtensor::train::pack(
        docs, [&](const std::string& d) { return tok.encode(d); },
        *tok.token_id("<|begin_of_text|>"), *tok.token_id("<|end_of_text|>"));
    nlohmann::json out{{"docs", docs},
                       {"tokens", packed.tokens},
                       {"doc_of", packed.doc_of},
                       {"sequences", dtensor::train::num_sequences(packed, seq)}};
    for (int64_t dp : {1, 2, 4}) {
      out["runs"][std::to_string(dp)] = batches(packed, seq, batch, dp, 0, steps);
    }
    Loader first(packed, seq, batch, 0, 4, 7);
    for (int64_t s = 0; s < resume; ++s) {
      first.next();
    }
    out["resumed"] = batches(packed, seq, batch, 2, first.position(), steps - resume);
    std::cout << out.dump() << "\n";
  } catch (const std::invalid_argument& e) {
    std::cout << "refused: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
