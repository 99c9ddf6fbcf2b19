// Train, reshard, generate: half of the ranks train a small Llama with FSDP on a sentence
// repeated (bytes as tokens), then every rank joins dtensor::reshard, which moves the trained
// weights point-to-point into a tensor-parallel generator on the other half, and the
// generator continues three prompts greedily with its KV cache (sharded by head). Run it on
// 2, 4 or 8 ranks:
//   torchrun --standalone --nproc-per-node 4 --no-python build/examples/generate
// `scripts/test.sh` runs it on 4 (test `generate_example-w4`). docs/generate.md.
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <dtensor/all.h>
#include <dtensor/reshard.h>
#include <models/llama3.h>
#include <models/llama3/generate.h>

namespace {

const std::string kText = "the quick brown fox jumps over the lazy dog. ";
constexpr int64_t kSeq = 32;

dtensor::models::Llama3Args model_args() {
  return dtensor::models::llama3_tiny_args().n_heads(8).n_kv_heads(4).max_seq_len(64);
}

std::vector<int64_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

// A batch of windows of the repeated text at random offsets: inputs and next-byte targets.
std::pair<at::Tensor, at::Tensor> batch(int64_t rows) {
  std::string long_text;
  while (long_text.size() < kText.size() + kSeq + 1) {
    long_text += kText;
  }
  const at::Tensor all = at::tensor(bytes(long_text), at::kLong);
  std::vector<at::Tensor> windows;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = at::randint(static_cast<int64_t>(kText.size()), {1}).item<int64_t>();
    windows.push_back(all.narrow(0, at, kSeq + 1));
  }
  const at::Tensor w = at::stack(windows);
  return {w.narrow(1, 0, kSeq), w.narrow(1, 1, kSeq)};
}

// FSDP over the trainers (dp_shard), 150 AdamW steps; the last loss.
double train(dtensor::models::Llama3& model, const dtensor::DeviceMesh& mesh) {
  dtensor::models::parallelize_llama3(model, mesh, /*loss_parallel=*/false);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  at::manual_seed(mesh.get_local_rank("dp_shard")); // each trainer its own windows
  double loss_value = 0;
  for (int step = 0; step < 150; ++step) {
    auto [x, y] = batch(8);
    const at::Tensor logits = dtensor::call(*model, x);
    at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                           y.reshape({-1}));
    opt.zero_grad();
    loss.backward();
    opt.step();
    loss_value = loss.item<double>();
  }
  return loss_value;
}

} // namespace

int main() {
  try {
    at::set_num_threads(1);
    dtensor::init_process_group();
    const int64_t world = dtensor::get_world_size();
    if (world < 2 || world % 2 != 0) {
      std::fprintf(stderr, "generate: run it on an even number of ranks (2, 4, 8)\n");
      return 2;
    }
    // (role, ...): role 0 trains on its half, role 1 generates on the other.
    const auto roles = dtensor::init_device_mesh(c10::kCPU, {2, 1, world / 2, 1},
                                                 {"role", "dp_replicate", "dp_shard", "tp"});
    const bool trainer = roles.get_local_rank("role") == 0;
    dtensor::models::Llama3 model(model_args());
    dtensor::StateDict source, target;
    if (trainer) {
      dtensor::set_rng_state({true, 0, 0});
      model->init_weights();
      const double loss = train(model, roles[{"dp_replicate", "dp_shard", "tp"}]);
      if (roles.get_local_rank("dp_shard") == 0) {
        std::printf("trainers: FSDP over %lld ranks, 150 steps, loss %.4f\n",
                    static_cast<long long>(world / 2), loss);
      }
      source = dtensor::get_model_state_dict(*model);
    } else {
      dtensor::models::parallelize_llama3_generator(model, roles["dp_shard"]);
      target = dtensor::get_model_state_dict(*model);
    }
    std::fflush(stdout);
    const dtensor::ReshardStats moved = dtensor::reshard(source, target);
    if (trainer) {
      return 0;
    }
    const std::vector<std::string> prompts = {"the quick", "over the", "lazy"};
    std::vector<std::vector<int64_t>> ids;
    for (const auto& p : prompts) {
      ids.push_back(bytes(p));
    }
    const auto out = dtensor::models::generate(
        model, ids, dtensor::models::GenerateOptions().max_new_tokens(24));
    if (roles.get_local_rank("dp_shard") == 0) {
      std::printf("generator: TP over %lld ranks, %lld bytes received by reshard, KV cache %lld "
                  "bytes a rank\n",
                  static_cast<long long>(world / 2), static_cast<long long>(moved.bytes_received),
                  static_cast<long long>(out.kv_cache_bytes));
      for (size_t i = 0; i < prompts.size(); ++i) {
        std::printf("%s|%s\n", prompts[i].c_str(),
                    std::string(out.tokens[i].begin(), out.tokens[i].end()).c_str());
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generate: %s\n", e.what());
    return 1;
  }
}
