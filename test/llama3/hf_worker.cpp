// One job of test/llama3/hf_driver.py: the Llama-3 model (models/llama3.h) on a
// (dp_replicate, dp_shard, tp) mesh, built on meta; either initialized from a seed and
// exported to Hugging Face's format, or loaded from a Hugging Face directory. Writes the
// logits of a fixed batch (a safetensors checkpoint holding "logits", full) for the driver
// to judge against transformers' LlamaForCausalLM (Qwen3MoeForCausalLM for the tiny
// Qwen3-MoE: export-qwen3-moe, or a loaded Qwen3-MoE directory; its experts over EP ranks).
//
//   torchrun --nproc-per-node N llama3_hf_worker export|export-qwen3|export-qwen3-moe|load HF_DIR
//   LOGITS_DIR AxBxC [EP]
#include <iostream>
#include <sstream>

#include <dtensor/all.h>

#include <models/llama3.h>

namespace {

using dtensor::models::Llama3;
using dtensor::models::Llama3Args;

std::vector<int64_t> parse_shape(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, 'x')) {
    out.push_back(std::stoll(part));
  }
  TORCH_CHECK(out.size() == 3, "mesh shape must be AxBxC, got ", s);
  return out;
}

// The driver's batch: tokens[b][s] = (31 b + 7 s + 3) mod vocab, 2 x 8.
at::Tensor tokens(int64_t vocab) {
  at::Tensor b = at::arange(2, at::kLong).unsqueeze(1);
  at::Tensor s = at::arange(8, at::kLong).unsqueeze(0);
  return (b * 31 + s * 7 + 3).remainder(vocab);
}

Llama3 build(const Llama3Args& args, const dtensor::DeviceMesh& mesh, int64_t ep) {
  Llama3 model{nullptr};
  {
    dtensor::MetaDeviceGuard meta;
    model = Llama3(args);
  }
  dtensor::models::parallelize_llama3(model, mesh, /*loss_parallel=*/false, {}, std::nullopt,
                                      std::nullopt, ep);
  dtensor::to_empty(*model, c10::Device(c10::kCPU));
  return model;
}

void run(const std::string& mode, const std::string& hf_dir, const std::string& logits_dir,
         const std::vector<int64_t>& shape, int64_t ep) {
  const auto mesh = dtensor::init_device_mesh(c10::kCPU, shape, {"dp_replicate", "dp_shard", "tp"});
  const bool exporting = mode.rfind("export", 0) == 0;
  const Llama3Args args = mode == "export" ? dtensor::models::llama3_tiny_args()
                          : mode == "export-qwen3"
                              ? dtensor::models::llama3_tiny_args().qk_norm(true)
                          : mode == "export-qwen3-moe" ? dtensor::models::qwen3_moe_tiny_args()
                                                       : dtensor::models::args_from_hf(hf_dir);
  Llama3 model = build(args, mesh, ep);
  if (exporting) {
    dtensor::set_rng_state({true, 11, 0});
    model->init_weights();
    if (mode != "export") { // norms off one, so that q / k norms' layout counts
      torch::NoGradGuard no_grad;
      for (auto& item : model->named_parameters()) {
        if (item.key().find("norm") != std::string::npos) {
          dtensor::normal_(item.value(), 1.0, 0.1);
        }
      }
    }
  } else {
    TORCH_CHECK(mode == "load", "unknown mode ", mode);
    dtensor::models::load_hf(model, hf_dir);
  }
  torch::NoGradGuard no_grad;
  at::Tensor logits = dtensor::call(model, tokens(args.vocab_size()));
  if (dtensor::is_dtensor(logits)) {
    logits = dtensor::DTensor(logits).full_tensor();
  }
  dtensor::StateDict out;
  out.insert("logits", logits.contiguous());
  dtensor::checkpoint::save(out, logits_dir);
  if (exporting) {
    dtensor::models::export_hf(model, hf_dir);
  }
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::cerr << "usage: llama3_hf_worker export|export-qwen3|export-qwen3-moe|load HF_DIR "
                 "LOGITS_DIR AxBxC [EP]\n";
    return 2;
  }
  dtensor::init_process_group();
  try {
    run(argv[1], argv[2], argv[3], parse_shape(argv[4]), argc == 6 ? std::stoll(argv[5]) : 1);
  } catch (const std::exception& e) {
    std::cerr << "llama3_hf_worker: " << e.what() << std::endl;
    return 1;
  }
  dtensor::destroy_process_group();
  return 0;
}
