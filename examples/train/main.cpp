// The main job (scripts/demo.sh): `train [--model llama|gpt] [flags]`. llama (the default) is
// torchtitan's Llama 3 recipe (examples/train/llama.cpp); gpt the small GPT-style Transformer
// of the first waves (examples/train/gpt.cpp), which the fp16, compression-hook and checkpoint
// tests drive. `--simulate WORLD` plans the recipe on a simulated world
// (examples/train/simulate.cpp).
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <dtensor/process_group.h>

#include "common.h"

int main(int argc, char** argv) {
  std::string model = "llama";
  char* model_arg = nullptr;
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--model" && i + 1 < argc) {
      model_arg = argv[++i];
      model = model_arg;
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (model.rfind("llama3-", 0) == 0) { // a torchtitan flavor of the Llama recipe
    rest.push_back(const_cast<char*>("--preset"));
    rest.push_back(model_arg);
    model = "llama";
  }
  if (model != "llama" && model != "gpt") {
    std::fprintf(stderr, "train: --model takes llama, llama3-8b|70b|405b or gpt, got %s\n",
                 model.c_str());
    return 2;
  }
  try {
    if (std::find_if(argv + 1, argv + argc, [](const char* a) {
          return std::string(a) == "--simulate";
        }) != argv + argc) {
      return dtensor::train::run_simulate(argc, argv); // plans; runs the recipe as children
    }
    const int n = static_cast<int>(rest.size());
    return model == "llama" ? dtensor::train::run_llama(n, rest.data())
                            : dtensor::train::run_gpt(n, rest.data());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train: error on rank %d: %s\n",
                 dtensor::is_initialized() ? dtensor::get_rank() : -1, e.what());
    return 1;
  }
}
