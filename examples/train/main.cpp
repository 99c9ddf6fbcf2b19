// The main job (scripts/demo.sh): `train [--model llama|<flavor>] [flags]` (flavors:
// recipe_flavors() in llama_flags.h), torchtitan's Llama 3 recipe (examples/train/llama.cpp; `train
// --help` lists its flags). `--simulate WORLD` plans the recipe on a simulated world
// (examples/train/simulate.cpp); `--plan N` searches the layouts (examples/train/plan.cpp).
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <dtensor/process_group.h>

#include "common.h"
#include "llama_flags.h"

int main(int argc, char** argv) {
  const auto has = [&](const char* flag) {
    return std::find_if(argv + 1, argv + argc, [flag](const char* a) {
             return std::string(a) == flag;
           }) != argv + argc;
  };
  if (has("--plan")) { // the layout search names models by shape, recipe flavors or not
    try {
      return dtensor::train::run_plan(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "train --plan: %s\n", e.what());
      return 2;
    }
  }
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
  const auto& flavors = dtensor::train::recipe_flavors();
  if (std::find(flavors.begin(), flavors.end(), model) != flavors.end()) {
    rest.push_back(const_cast<char*>("--preset")); // a flavor of the recipe's model
    rest.push_back(model_arg);
    model = "llama";
  }
  if (model != "llama") {
    std::string names = "llama";
    for (const std::string& f : flavors) {
      names += "|" + f;
    }
    std::fprintf(stderr, "train: --model takes %s, got %s\n", names.c_str(), model.c_str());
    return 2;
  }
  try {
    if (has("--simulate")) {
      return dtensor::train::run_simulate(argc, argv); // plans; runs the recipe as children
    }
    return dtensor::train::run_llama(static_cast<int>(rest.size()), rest.data());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train: error on rank %d: %s\n",
                 dtensor::is_initialized() ? dtensor::get_rank() : -1, e.what());
    return 1;
  }
}
