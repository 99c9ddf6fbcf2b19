// Models larger than one device: a Transformer built on the meta device,
// parallelized in every layout (replicate, FSDP, TP, FSDP x TP, HSDP x TP), given memory by
// to_empty and values by a layout-independent init. Judged against the plain model on one
// process: the initial full values are equal bit for bit, and training with dropout 0.1,
// AdamW and clip_grad_norm_ gives the plain model's losses, norms and parameters, on 1, 2,
// 4 and 8 ranks. Memory is judged by a counting CPU allocator, not by dtensor's own figures:
// after init a rank holds exactly its shards, and the peak during init is at most its shards
// plus the largest single shard.
#include <set>

#include <c10/core/CachingDeviceAllocator.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include "parallel/fsdp/fsdp_param_group.h" // white box: a unit's flat shard, for the exact byte count
#include "support/cpu_memory.h"
#include "support/prelude.h"
#include "support/transformer_tp.h"

using dtensor::models::Transformer;
using dtensor::testing::batch_slice;
using dtensor::testing::kBatch;
using dtensor::testing::kSeq;
using dtensor::testing::kVocab;
using dtensor::testing::CountingCPUAllocator;
using dtensor::testing::near;
using dtensor::testing::parallelize_transformer_tp;
using dtensor::testing::small_transformer_args;
using dtensor::testing::whole;

namespace {


// A layout: the mesh (data-parallel dims first, then "tp") and what runs on it.
struct Layout {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  bool replicate = false;
  bool fsdp = false;
  bool tp = false;
};

std::vector<Layout> layouts() {
  const int64_t w = world();
  std::vector<Layout> out{
      {"replicate", {w}, {"dp"}, true, false, false},
      {"FSDP", {w}, {"dp"}, false, true, false},
      {"TP", {w}, {"tp"}, false, false, true},
  };
  const int64_t tp = w >= 2 ? 2 : 1;
  out.push_back({"FSDP x TP", {w / tp, tp}, {"dp", "tp"}, false, true, true});
  std::vector<std::vector<int64_t>> hsdp;
  if (w == 8) {
    hsdp = {{2, 2, 2}};
  } else if (w == 4) {
    hsdp = {{1, 2, 2}, {2, 1, 2}, {2, 2, 1}};
  } else if (w == 2) {
    hsdp = {{1, 1, 2}, {2, 1, 1}};
  } else {
    hsdp = {{1, 1, 1}};
  }
  for (const auto& s : hsdp) {
    out.push_back({"HSDP x TP", s, {"dp_replicate", "dp_shard", "tp"}, false, true, true});
  }
  return out;
}

// The data-parallel dims of the layout's mesh (undefined for TP alone).
DeviceMesh dp_mesh(const Layout& l, const DeviceMesh& mesh) {
  std::vector<std::string> dp;
  for (const auto& n : l.names) {
    if (n != "tp") {
      dp.push_back(n);
    }
  }
  if (dp.empty()) {
    return {};
  }
  return dp.size() == 1 ? mesh[dp[0]] : mesh[dp];
}

// Built on meta and parallelized: no parameter has memory yet. (`handle` keeps replicate's
// state alive.)
Transformer build_on_meta(const Layout& l, const DeviceMesh& mesh,
                          std::optional<dtensor::ReplicateHandle>& handle) {
  Transformer model{nullptr};
  {
    dtensor::MetaDeviceGuard meta;
    model = Transformer(small_transformer_args());
  }
  const DeviceMesh dp = dp_mesh(l, mesh);
  if (l.tp) {
    parallelize_transformer_tp(model, mesh["tp"]);
    if (!l.fsdp) { // the other parameters Replicate (fully_shard takes them as they are)
      dtensor::distribute_module(*model, mesh["tp"], nullptr);
    }
  }
  if (l.fsdp) {
    for (auto& layer : *model->layers) {
      dtensor::fully_shard(*layer, FullyShardOptions().mesh(dp));
    }
    dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  }
  if (l.replicate) {
    handle = dtensor::replicate(*model, dp);
  }
  for (const auto& p : model->parameters()) {
    REQUIRE(p.is_meta());
  }
  return model;
}

// The bytes an allocation of `n` takes: exact on the CPU (the counting allocator); in blocks
// of 512 on a GPU (the CUDA caching allocator's rounding, which its statistics count).
int64_t block_bytes(int64_t n) {
  if (device_type() != c10::kCUDA || n == 0) {
    return n;
  }
  return (n + 511) / 512 * 512;
}

// The CUDA caching allocator's statistics (libc10's DeviceAllocator interface: no CUDA
// library is linked) for this rank's GPU, from construction: bytes allocated and their peak.
class DeviceMemoryWindow {
 public:
  DeviceMemoryWindow() {
    if (device_type() == c10::kCUDA) {
      c10::getDeviceAllocator(c10::kCUDA)->resetPeakStats(index());
      start_ = aggregate().current;
    }
  }
  int64_t live() const { return aggregate().current - start_; }
  int64_t peak() const { return aggregate().peak - start_; }

 private:
  static c10::DeviceIndex index() { return options().device().index(); }
  static c10::CachingDeviceAllocator::Stat aggregate() {
    return c10::getDeviceAllocator(c10::kCUDA)
        ->getDeviceStats(index())
        .allocated_bytes[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)];
  }
  int64_t start_ = 0;
};

// What this rank holds of the model after to_empty: each unit's flat shard (padding
// included), and each other parameter's local tensor. The largest single shard too.
struct OwnBytes {
  int64_t own = 0;           // this rank's parameter memory
  int64_t largest = 0;       // its largest parameter's
  int64_t largest_numel = 0; // and the most elements one parameter has here
};

OwnBytes own_bytes(Transformer& model) {
  int64_t own = 0;
  int64_t largest = 0;
  int64_t largest_numel = 0;
  std::set<const void*> units;
  for (const auto& p : model->parameters()) {
    int64_t bytes = 0;
    int64_t numel = 0;
    if (auto tag = dtensor::detail::fsdp_tag(p)) {
      auto group = tag->group.lock();
      const auto& fp = group->params.at(tag->index);
      numel = fp.segment_numel();
      bytes = block_bytes(numel * p.element_size());
      if (units.insert(group.get()).second) {
        own += block_bytes(static_cast<int64_t>(group->flat_shard.nbytes()));
      }
    } else {
      const at::Tensor local = dtensor::is_dtensor(p) ? DTensor(p).to_local() : p;
      numel = local.numel();
      bytes = block_bytes(static_cast<int64_t>(local.nbytes()));
      own += bytes;
    }
    largest = std::max(largest, bytes);
    largest_numel = std::max(largest_numel, numel);
  }
  return {own, largest, largest_numel};
}

// [Note: Philox in int64 tensor ops] (lib/tensor/random/philox.cpp): off the CPU the
// layout-independent draws run as tensor ops, one chunk of at most 2^16 elements at a time
// (sample.cpp's kChunk), with about a dozen int64 temporaries of the chunk alive at once;
// 24 bounds them.
int64_t philox_workspace(int64_t numel) {
  return 24 * block_bytes(8 * std::min<int64_t>(numel, int64_t{1} << 16));
}

} // namespace

TEST_CASE("meta init: every layout equals the plain model, and trains like it with dropout",
          "[meta_init][world1][world2][world4][world8]") {
  CountingCPUAllocator& memory = CountingCPUAllocator::install();
  for (const Layout& l : layouts()) {
    const DeviceMesh mesh = init_device_mesh(device_type(), l.shape, l.names);
    INFO("layout " << l.name << " on " << mesh.to_string());
    const DeviceMesh dp = dp_mesh(l, mesh);
    std::optional<dtensor::ReplicateHandle> handle;
    memory.mark();
    Transformer model = build_on_meta(l, mesh, handle);
    REQUIRE(memory.window_peak() == 0); // nothing allocated on meta

    // Materialize and initialize: only this rank's shards, ever (on a GPU: there, and
    // nothing on the host).
    memory.mark();
    DeviceMemoryWindow device_memory;
    const dtensor::RngState seeded{true, 7, 0};
    dtensor::set_rng_state(seeded);
    dtensor::to_empty(*model, options().device());
    dtensor::models::init_weights(*model);
    const auto [own, largest, largest_numel] = own_bytes(model);
    if (device_type() == c10::kCUDA) {
      CHECK(memory.window_live() == 0);
      CHECK(device_memory.live() == own);
      CHECK(device_memory.peak() <= own + largest + philox_workspace(largest_numel));
    } else {
      CHECK(memory.window_live() == own);
      CHECK(memory.window_peak() <= own + largest);
    }

    // The plain model, initialized by the same rule on this one process.
    Transformer ref(small_transformer_args());
    ref->to(options().device());
    dtensor::set_rng_state(seeded);
    dtensor::models::init_weights(*ref);
    auto p = model->named_parameters();
    auto q = ref->named_parameters();
    REQUIRE(p.size() == q.size());
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("initial " << p[i].key());
      REQUIRE(p[i].key() == q[i].key());
      REQUIRE(same(full_value(p[i].value()), q[i].value().detach()));
    }

    // Three steps of AdamW with clip_grad_norm_ and dropout 0.1. (eps 1e-3: AdamW's first
    // steps move a weight by about lr whatever its gradient's size, so a gradient at the level
    // of fp32 reduction noise would move it by lr in a direction the noise picks; eps keeps
    // such updates at noise level.)
    const auto adamw = torch::optim::AdamWOptions(1e-2).eps(1e-3);
    torch::optim::AdamW opt(model->parameters(), adamw);
    torch::optim::AdamW ref_opt(ref->parameters(), adamw);
    const auto [index, count] = batch_slice(dp);
    const int64_t rows = kBatch / count;
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      at::manual_seed(100 + step); // the same global batch on every rank
      auto tokens = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
      auto targets = at::randint(kVocab, {kBatch, kSeq}, options(at::kLong));
      auto my_tokens = tokens.narrow(0, index * rows, rows);
      auto my_targets = targets.narrow(0, index * rows, rows);
      const dtensor::RngState start = dtensor::get_rng_state();
      at::Tensor logits;
      {
        dtensor::BatchShardGuard slice(count, index);
        logits = model->forward(my_tokens);
      }
      auto loss = torch::nn::functional::cross_entropy(whole(logits).view({-1, kVocab}),
                                                       my_targets.reshape(-1));
      loss.backward();
      const double norm = dtensor::clip_grad_norm_(model->parameters(), 1.0).item<double>();
      opt.step();
      const dtensor::RngState end = dtensor::get_rng_state();

      dtensor::set_rng_state(start);
      auto ref_logits = ref->forward(tokens);
      REQUIRE(dtensor::get_rng_state().offset == end.offset); // the same random ops
      auto ref_loss = torch::nn::functional::cross_entropy(ref_logits.view({-1, kVocab}),
                                                           targets.view(-1));
      auto ref_my_loss = torch::nn::functional::cross_entropy(
          ref_logits.narrow(0, index * rows, rows).reshape({-1, kVocab}), my_targets.reshape(-1));
      ref_loss.backward();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 1.0);
      ref_opt.step();
      REQUIRE(near(loss.detach(), ref_my_loss.detach()));
      for (size_t i = 0; i < p.size(); ++i) {
        INFO("clipped grad " << p[i].key());
        REQUIRE(near(full_value(p[i].value().grad()), q[i].value().grad()));
      }
      REQUIRE(std::abs(norm - ref_norm) <= 1e-4 * std::max(1.0, ref_norm));
      opt.zero_grad();
      ref_opt.zero_grad();
      for (size_t i = 0; i < p.size(); ++i) {
        INFO("param " << p[i].key());
        REQUIRE(near(full_value(p[i].value()), q[i].value().detach()));
      }
    }
  }
}

TEST_CASE("meta init: MetaDeviceGuard leaves the thread's dispatch keys as it found them",
          "[meta_init][world1]") {
  const auto before = c10::impl::tls_local_dispatch_key_set();
  {
    dtensor::MetaDeviceGuard outer;
    REQUIRE(at::zeros({2}).is_meta());
    {
      dtensor::MetaDeviceGuard inner; // nested: still meta, and undone once
      REQUIRE(at::ones({2}).is_meta());
    }
    REQUIRE(at::empty({2}).is_meta());
  }
  const auto after = c10::impl::tls_local_dispatch_key_set();
  CHECK(after.included_.raw_repr() == before.included_.raw_repr());
  CHECK(after.excluded_.raw_repr() == before.excluded_.raw_repr());
  // An op on a CPU tensor afterwards runs its CPU kernel (on LibTorch 2.9.1, undoing an
  // Include guard left Meta's backend bit behind and this sum came out meta).
  const at::Tensor sum = at::ones({3}).sum();
  REQUIRE(sum.device().is_cpu());
  CHECK(sum.item<float>() == 3.0F);
}

TEST_CASE("meta init: errors name what is wrong", "[meta_init][world1][world2]") {
  const DeviceMesh mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  torch::nn::Linear lin{nullptr};
  {
    dtensor::MetaDeviceGuard meta;
    lin = torch::nn::Linear(4, 4);
  }
  REQUIRE_THROWS_WITH(dtensor::to_empty(*lin, c10::Device(c10::kMeta)),
                      contains("must be a real device"));
  // A unit of meta and real parameters.
  torch::nn::Sequential mixed;
  mixed->push_back(lin);
  mixed->push_back(torch::nn::Linear(4, 4));
  REQUIRE_THROWS_WITH(dtensor::fully_shard(*mixed, FullyShardOptions().mesh(mesh)),
                      contains("all on the meta device or none"));
}
