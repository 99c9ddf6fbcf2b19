// One job of test/llama3/hf_driver.py: the Llama-3 model (models/llama3.h) on a
// (dp_replicate, dp_shard, tp) mesh, built on meta; either initialized from a seed and
// exported to Hugging Face's format, or loaded from a Hugging Face directory. Writes the
// logits of a fixed batch (a safetensors checkpoint holding "logits", full) for the driver
// to judge against transformers' LlamaForCausalLM (Qwen3MoeForCausalLM for the tiny
// Qwen3-MoE: export-qwen3-moe, or a loaded Qwen3-MoE directory; its experts over EP ranks).
//
//   torchrun --nproc-per-node N llama3_hf_worker export|export-qwen3|export-qwen3-moe|load|
//   load-export HF_DIR LOGITS_DIR AxBxC [EP [MAX_SHARD_BYTES]]
// (load-export: loads HF_DIR, then exports what it holds to LOGITS_DIR-hf.)
//
// A load also measures every rank's tensor allocations while it reads (the counting CPU
// allocator, test/support/cpu_memory.h) and fails unless their peak stays within the rank's
// own share of the model plus the folder's largest file: no rank builds a full tensor it does
// not own.
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <sstream>

#include <dtensor/all.h>

#include <models/llama3.h>

#include "../support/cpu_memory.h"

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

// This rank's bytes of the model's state (its pieces).
int64_t own_bytes(Llama3& model) {
  int64_t n = 0;
  for (const auto& item : dtensor::get_model_state_dict(*model)) {
    const at::Tensor& t = item.value();
    n += static_cast<int64_t>(
        (dtensor::is_dtensor(t) ? dtensor::DTensor(t).to_local() : t).nbytes());
  }
  return n;
}

int64_t largest_file(const std::string& dir) {
  int64_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") {
      n = std::max(n, static_cast<int64_t>(e.file_size()));
    }
  }
  return n;
}

// load_hf, its allocations' peak checked against the rank's share plus one file.
void load_measured(Llama3& model, const std::string& hf_dir) {
  auto& counter = dtensor::testing::CountingCPUAllocator::install();
  const int64_t own = own_bytes(model);
  const int64_t bound = own + largest_file(hf_dir);
  counter.mark();
  dtensor::models::load_hf(model, hf_dir);
  const int64_t peak = counter.window_peak();
  std::cout << "rank " << dtensor::get_rank() << ": load peak " << peak << " bytes; own share "
            << own << ", bound " << bound << std::endl;
  TORCH_CHECK(peak <= bound, "rank ", dtensor::get_rank(), ": loading allocated ", peak,
              " bytes at its peak, more than its share ", own, " plus the largest file");
}

void run(const std::string& mode, const std::string& hf_dir, const std::string& logits_dir,
         const std::vector<int64_t>& shape, int64_t ep, int64_t max_shard_bytes) {
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
    TORCH_CHECK(mode == "load" || mode == "load-export", "unknown mode ", mode);
    load_measured(model, hf_dir);
  }
  torch::NoGradGuard no_grad;
  at::Tensor logits = dtensor::call(model, tokens(args.vocab_size()));
  if (dtensor::is_dtensor(logits)) {
    logits = dtensor::DTensor(logits).full_tensor();
  }
  dtensor::StateDict out;
  out.insert("logits", logits.contiguous());
  dtensor::checkpoint::save(out, logits_dir);
  if (exporting || mode == "load-export") { // load-export: what it read, to LOGITS_DIR-hf
    dtensor::models::export_hf(model, exporting ? hf_dir : logits_dir + "-hf",
                               dtensor::models::HfExportOptions().max_shard_bytes(max_shard_bytes));
  }
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 5 || argc > 7) {
    std::cerr
        << "usage: llama3_hf_worker export|export-qwen3|export-qwen3-moe|load|load-export HF_DIR "
           "LOGITS_DIR AxBxC [EP [MAX_SHARD_BYTES]]\n";
    return 2;
  }
  dtensor::testing::CountingCPUAllocator::install(); // before any tensor
  dtensor::init_process_group();
  try {
    run(argv[1], argv[2], argv[3], parse_shape(argv[4]), argc >= 6 ? std::stoll(argv[5]) : 1,
        argc == 7 ? std::stoll(argv[6]) : int64_t{50'000'000'000});
  } catch (const std::exception& e) {
    // One write, so that the ranks' lines do not interleave on the shared stderr.
    const std::string line =
        "llama3_hf_worker rank " + std::to_string(dtensor::get_rank()) + ": " + e.what() + "\n";
    (void)!::write(2, line.data(), line.size());
    return 1;
  }
  dtensor::destroy_process_group();
  return 0;
}
