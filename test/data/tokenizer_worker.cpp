// One job of test/data/tokenizer_judge.py: examples/train's HfTokenizer on a tokenizer.json
// and a text file. Prints the ids on one line (space-separated) and writes decode(ids) to
// OUT; a refused tokenizer.json prints "refused: <why>" and exits 3.
//
//   tokenizer_worker TOKENIZER_JSON TEXT_FILE OUT
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "hf_tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: tokenizer_worker TOKENIZER_JSON TEXT_FILE OUT\n");
    return 2;
  }
  try {
    const dtensor::train::HfTokenizer tok(argv[1]);
    std::ifstream in(argv[2], std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    const std::vector<int64_t> ids = tok.encode(text.str());
    for (size_t i = 0; i < ids.size(); ++i) {
      std::cout << (i == 0 ? "" : " ") << ids[i];
    }
    std::cout << "\n";
    std::ofstream(argv[3], std::ios::binary) << tok.decode(ids);
  } catch (const std::invalid_argument& e) {
    std::cout << "refused: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
