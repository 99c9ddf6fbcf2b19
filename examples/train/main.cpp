// The main job (scripts/demo.sh): `train [--model llama|gpt] [flags]`. llama (the default) is
// torchtitan's Llama 3 recipe (examples/train/llama.cpp); gpt the small GPT-style Transformer
// of the first waves (examples/train/gpt.cpp), which the fp16, compression-hook and checkpoint
// tests drive.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <dtensor/process_group.h>

#include "common.h"

int main(int argc, char** argv) {
  std::string model = "llama";
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--model" && i + 1 < argc) {
      model = argv[++i];
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (model != "llama" && model != "gpt") {
    std::fprintf(stderr, "train: --model takes llama or gpt, got %s\n", model.c_str());
    return 2;
  }
  try {
    const int n = static_cast<int>(rest.size());
    return model == "llama" ? dtensor::train::run_llama(n, rest.data())
                            : dtensor::train::run_gpt(n, rest.data());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train: error on rank %d: %s\n",
                 dtensor::is_initialized() ? dtensor::get_rank() : -1, e.what());
    return 1;
  }
}
