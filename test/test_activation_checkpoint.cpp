// Activation checkpointing (dtensor/activation_checkpoint.h, docs/activation_checkpoint.md):
// full and selective, on the plain model, FSDP, TP and FSDP x TP with dropout on, judged by
// the plain model without checkpointing on one process (losses, clipped gradients,
// parameters over 3 AdamW steps); exact collective counts per step against the same layout
// without checkpointing; the activation memory it saves, measured by a counting allocator.
#include <cstdio>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include "support/cpu_memory.h"
#include "support/prelude.h"
#include "support/transformer_tp.h"

using dtensor::ActivationCheckpointOptions;
using dtensor::CollectiveKind;
using dtensor::CommDebugMode;
using dtensor::DeviceMesh;
using dtensor::FullyShardOptions;
using dtensor::models::Transformer;
using dtensor::testing::batch_slice;
using dtensor::testing::kBatch;
using dtensor::testing::kSeq;
using dtensor::testing::kVocab;
using dtensor::testing::near;
using dtensor::testing::parallelize_transformer_tp;
using dtensor::testing::small_transformer_args;
using dtensor::testing::whole;

namespace {

struct Layout {
  std::string name;
  std::vector<int64_t> shape; // empty: the plain model
  std::vector<std::string> names;
  bool fsdp = false;
  bool tp = false;
};

std::vector<Layout> layouts() {
  const int64_t w = world();
  const int64_t tp = w >= 2 ? 2 : 1;
  return {{"plain", {}, {}, false, false},
          {"FSDP", {w}, {"dp"}, true, false},
          {"TP", {w}, {"tp"}, false, true},
          {"FSDP x TP", {w / tp, tp}, {"dp", "tp"}, true, true}};
}

// Selective checkpointing as torchtitan's "op" mode: matmuls and attention saved.
ActivationCheckpointOptions selective() {
  return ActivationCheckpointOptions().policy(
      dtensor::save_ops({"aten::mm", "aten::addmm", "aten::bmm",
                         "aten::_scaled_dot_product_flash_attention_for_cpu"}));
}

std::optional<ActivationCheckpointOptions> mode(const std::string& name) {
  if (name == "full") {
    return ActivationCheckpointOptions();
  }
  if (name == "selective") {
    return selective();
  }
  return std::nullopt;
}

Transformer build(const Layout& l, const std::optional<DeviceMesh>& mesh,
                  const std::optional<ActivationCheckpointOptions>& ac) {
  Transformer model(small_transformer_args().activation_checkpoint(ac));
  model->to(options().device());
  if (l.tp) {
    parallelize_transformer_tp(model, (*mesh)["tp"]);
    if (!l.fsdp) {
      dtensor::distribute_module(*model, (*mesh)["tp"], nullptr);
    }
  }
  if (l.fsdp) {
    const DeviceMesh dp = (*mesh)["dp"];
    for (auto& layer : *model->layers) {
      dtensor::fully_shard(*layer, FullyShardOptions().mesh(dp));
    }
    dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  }
  dtensor::set_rng_state({true, 11, 0});
  dtensor::models::init_weights(*model);
  return model;
}

// Collectives of one step, by phase.
struct StepCounts {
  std::map<std::string, int64_t> forward, backward;
};

std::map<std::string, int64_t> by_kind(const CommDebugMode& m,
                                       const std::vector<std::string>& names) {
  std::map<std::string, int64_t> out;
  for (const auto& g : names) {
    for (auto k :
         {CollectiveKind::AllGather, CollectiveKind::AllReduce, CollectiveKind::ReduceScatter}) {
      if (const int64_t n = m.count(g, k)) {
        out[g + " " + dtensor::to_string(k)] = n;
      }
    }
  }
  return out;
}

// Three AdamW steps with clip and dropout: the losses, every clipped gradient and every
// parameter against the plain model without checkpointing; returns the last step's counts.
StepCounts train(const Layout& l, const std::optional<ActivationCheckpointOptions>& ac) {
  std::optional<DeviceMesh> mesh;
  if (!l.shape.empty()) {
    mesh = dtensor::init_device_mesh(device_type(), l.shape, l.names);
  }
  Transformer model = build(l, mesh, ac);
  Transformer ref = build({"plain", {}, {}, false, false}, std::nullopt, std::nullopt);
  const auto adamw = torch::optim::AdamWOptions(1e-2).eps(1e-3);
  torch::optim::AdamW opt(model->parameters(), adamw);
  torch::optim::AdamW ref_opt(ref->parameters(), adamw);
  const DeviceMesh dp = l.fsdp ? (*mesh)["dp"] : DeviceMesh();
  const auto [index, count] = batch_slice(dp);
  const int64_t rows = kBatch / count;
  auto p = model->named_parameters();
  auto q = ref->named_parameters();
  StepCounts counts;
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    at::manual_seed(500 + step);
    auto tokens = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
    auto targets = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
    auto my_targets = targets.narrow(0, index * rows, rows).reshape(-1);
    const dtensor::RngState start = dtensor::get_rng_state();
    at::Tensor loss;
    {
      dtensor::BatchShardGuard slice(count, index);
      CommDebugMode fwd;
      auto logits = model->forward(tokens.narrow(0, index * rows, rows));
      loss = torch::nn::functional::cross_entropy(whole(logits).view({-1, kVocab}), my_targets);
      counts.forward = by_kind(fwd, l.names);
    }
    {
      CommDebugMode bwd;
      loss.backward();
      counts.backward = by_kind(bwd, l.names);
    }
    const double norm = dtensor::clip_grad_norm_(model->parameters(), 1.0).item<double>();
    opt.step();
    const dtensor::RngState end = dtensor::get_rng_state();

    dtensor::set_rng_state(start);
    auto ref_logits = ref->forward(tokens);
    REQUIRE(dtensor::get_rng_state().offset == end.offset); // the recompute left no trace
    auto ref_my_loss = torch::nn::functional::cross_entropy(
        ref_logits.narrow(0, index * rows, rows).reshape({-1, kVocab}), my_targets);
    torch::nn::functional::cross_entropy(ref_logits.view({-1, kVocab}), targets.view(-1))
        .backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 1.0);
    ref_opt.step();
    REQUIRE(near(loss.detach(), ref_my_loss.detach()));
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("clipped grad " << p[i].key());
      REQUIRE(p[i].value().grad().defined());
      CHECK(near(full_value(p[i].value().grad()), q[i].value().grad()));
    }
    REQUIRE(std::abs(norm - ref_norm) <= 1e-4 * std::max(1.0, ref_norm));
    opt.zero_grad();
    ref_opt.zero_grad();
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("param " << p[i].key());
      REQUIRE(near(full_value(p[i].value()), q[i].value().detach()));
    }
  }
  return counts;
}

} // namespace

TEST_CASE("activation checkpointing: every layout trains like the plain model, with the "
          "recompute's collectives counted",
          "[activation_checkpoint][world1][world2][world4]") {
  for (const Layout& l : layouts()) {
    INFO("layout " << l.name);
    const StepCounts none = train(l, std::nullopt);
    const int64_t tp = l.tp ? l.shape.back() : 1;
    const int64_t blocks = small_transformer_args().n_layers();
    for (const std::string m : {"full", "selective"}) {
      INFO("checkpointing " << m);
      const StepCounts with = train(l, mode(m));
      // Forward: the same collectives. Backward: fully_shard's the same (the recompute uses
      // the unit backward unshards anyway); tensor parallelism's forward ones again, per
      // block: the all-reduce of each row-wise projection (wo, w2).
      CHECK(with.forward == none.forward);
      auto expected = none.backward;
      if (tp > 1) {
        expected["tp all_reduce"] += 2 * blocks;
      }
      CHECK(with.backward == expected);
    }
    if (l.fsdp) { // per step, U = 3 units; none over a dp dim of one rank
      const int64_t units = blocks + 1;
      const int64_t dp = l.shape.front();
      auto count = [](const std::map<std::string, int64_t>& m, const std::string& k) {
        return m.count(k) != 0 ? m.at(k) : 0;
      };
      CHECK(count(none.forward, "dp all_gather") == over(dp, units));
      CHECK(count(none.backward, "dp all_gather") == over(dp, units - 1));
      CHECK(count(none.backward, "dp reduce_scatter") == over(dp, units));
    }
  }
}

namespace {

struct Memory {
  int64_t saved = 0; // what forward leaves allocated for backward
  int64_t peak = 0;  // the peak over forward and backward
};

// One forward + backward of a larger plain Transformer, measured by the counting allocator
// (relative to what lived before the forward).
Memory measure(const std::optional<ActivationCheckpointOptions>& ac, int64_t layers) {
  auto& memory = dtensor::testing::CountingCPUAllocator::install();
  Transformer model(dtensor::models::ModelArgs()
                        .n_layers(layers)
                        .vocab_size(64)
                        .max_seq_len(64)
                        .dim(64)
                        .n_heads(4)
                        .dropout_p(0.1)
                        .weight_tying(false)
                        .layout_independent_dropout(true)
                        .activation_checkpoint(ac));
  at::manual_seed(7);
  auto tokens = at::randint(64, {8, 64}, at::TensorOptions().dtype(at::kLong));
  Memory m;
  memory.mark();
  auto loss = model->forward(tokens).square().mean();
  m.saved = memory.window_live();
  loss.backward();
  m.peak = memory.window_peak();
  return m;
}

} // namespace

TEST_CASE("activation checkpointing: the activations it does not keep, measured",
          "[activation_checkpoint][world1]") {
  const int64_t layers = 4;
  const Memory none = measure(std::nullopt, layers);
  const Memory full = measure(ActivationCheckpointOptions(), layers);
  const Memory sel = measure(selective(), layers);
  const Memory one_block_none = measure(std::nullopt, 1);
  const Memory zero_blocks = measure(std::nullopt, 0);
  // A block's saved activations, from the difference of two models without checkpointing;
  // what a checkpointed block keeps: its input [8, 64, 64] fp32, and the CPU generator's
  // state for the replay (torch.get_rng_state()'s bytes).
  const int64_t block = one_block_none.saved - zero_blocks.saved;
  const int64_t input = 8 * 64 * 64 * 4;
  const int64_t rng = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  std::printf("[activation_checkpoint] kept after forward (bytes): none %lld, full %lld, "
              "selective %lld; without blocks %lld; one block's activations %lld\n"
              "[activation_checkpoint] peak over forward + backward (bytes): none %lld, full "
              "%lld, selective %lld\n",
              static_cast<long long>(none.saved), static_cast<long long>(full.saved),
              static_cast<long long>(sel.saved), static_cast<long long>(zero_blocks.saved),
              static_cast<long long>(block), static_cast<long long>(none.peak),
              static_cast<long long>(full.peak), static_cast<long long>(sel.peak));
  // Full: exactly the activations outside the blocks, and per block its input and the
  // random state.
  CHECK(full.saved == zero_blocks.saved + layers * (input + rng));
  // Selective keeps more (the matmuls' and attention's outputs), less than none.
  CHECK(full.saved < sel.saved);
  CHECK(sel.saved < none.saved);
  // The peak: what full keeps, one block recomputed at a time, the transient of backward
  // without checkpointing (the loss's and logits' gradients), and the gradients of the
  // block's output and input that the checkpoint node holds while its inner backward runs.
  CHECK(full.peak <= full.saved + block + (none.peak - none.saved) + 2 * input);
  CHECK(full.peak < sel.peak);
  CHECK(sel.peak < none.peak);
}

namespace {
struct SmallBlockImpl : torch::nn::Module {
  SmallBlockImpl() : lin(register_module("lin", torch::nn::Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& x) { return torch::gelu(lin(x)) + x; }
  torch::nn::Linear lin;
};
TORCH_MODULE(SmallBlock);
} // namespace

TEST_CASE("activation checkpointing: CheckpointWrapper in a Sequential",
          "[activation_checkpoint][world1]") {
  auto make = [](bool wrap) {
    torch::manual_seed(3);
    torch::nn::Sequential seq;
    for (int i = 0; i < 3; ++i) {
      SmallBlock block;
      if (wrap) {
        seq->push_back(dtensor::CheckpointWrapper(block));
      } else {
        seq->push_back(block);
      }
    }
    return seq;
  };
  auto plain = make(false);
  auto wrapped = make(true);
  auto x = torch::randn({4, 8});
  plain->forward(x).pow(2).sum().backward();
  wrapped->forward(x).pow(2).sum().backward();
  auto p = plain->named_parameters();
  auto q = wrapped->named_parameters();
  REQUIRE(p.size() == q.size());
  for (size_t i = 0; i < p.size(); ++i) {
    // checkpoint_wrapper's naming: the inner module under "module."
    const std::string k = p[i].key();
    const std::string expected =
        k.substr(0, k.find('.') + 1) + "module." + k.substr(k.find('.') + 1);
    CHECK(q[i].key() == expected);
    CHECK(torch::equal(p[i].value().grad(), q[i].value().grad()));
  }
}

// Guards [Note: the call's state holds no output] (dtensor/module_hooks.h): a module
// checkpointed through checkpoint_module and called through dtensor::call keeps nothing of a
// step once its graph is gone: the input it saved is released after backward and when the
// graph is dropped without one (the cycle through the recompute function leaked both, every
// call: the recipe's resident memory grew by the blocks' inputs every step).
TEST_CASE("activation checkpointing: a checkpointed call keeps nothing once its graph is gone",
          "[activation_checkpoint][world1]") {
  SmallBlock block;
  dtensor::checkpoint_module(*block);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  const auto baseline = x.use_count();
  {
    at::Tensor y = dtensor::call(block, x);
    CHECK(x.use_count() > baseline); // saved for the recompute
    y.pow(2).sum().backward();
  }
  CHECK(x.use_count() == baseline);
  {
    at::Tensor y = dtensor::call(block, x); // dropped without a backward
  }
  CHECK(x.use_count() == baseline);
  CHECK(x.grad().defined());
}

TEST_CASE("activation checkpointing: errors name what is wrong",
          "[activation_checkpoint][world1]") {
  auto w = torch::randn({4, 4}, torch::requires_grad());
  auto x = torch::randn({4, 4}, torch::requires_grad());
  // A function that runs other ops in the recompute than in forward.
  int calls = 0;
  auto diverging = [&](const at::Tensor& a) {
    ++calls;
    return calls == 1 ? a.mm(w) : a.addmm(a, w);
  };
  auto y = dtensor::activation_checkpoint(
      diverging, x,
      ActivationCheckpointOptions().policy(dtensor::save_ops({"aten::mm", "aten::addmm"})));
  REQUIRE_THROWS_WITH(
      y.sum().backward(),
      Catch::Matchers::Contains("the recompute ran aten::addmm where forward ran aten::mm"));
  // An undefined output.
  REQUIRE_THROWS_WITH(
      dtensor::activation_checkpoint([](const at::Tensor&) { return at::Tensor(); }, x),
      Catch::Matchers::Contains("activation_checkpoint: output 0 of the function is undefined"));
  // Without grad mode nothing is saved or recomputed: the function runs once.
  calls = 0;
  {
    at::NoGradGuard no_grad;
    dtensor::activation_checkpoint(diverging, x);
  }
  CHECK(calls == 1);
}
