// fully_shard's overlap of communication with compute ([Note: overlap] in
// lib/parallel/fsdp/fsdp_state.cpp): the prefetch order seen from inside the model and in
// CommDebugMode's record order, counts and values equal with overlap off, and the memory
// bound of docs/fsdp.md.
#include <algorithm>
#include <map>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"
#include <dtensor/replicate.h>

using dtensor::CollectiveRecord;
using dtensor::FSDPModule;

namespace {

constexpr int64_t kDim = 4;
constexpr int kBlocks = 4;

// The identity, whose backward throws: a backward that fails half-way.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error("injected backward failure");
  }
};

// Linear-ReLU-Linear of hidden width 8 (i + 1): each block's flat shard has its own size,
// which names the block in CommDebugMode's records. `probe` runs right after the block's
// first op, while its compute is under way.
struct ProbeBlockImpl : torch::nn::Module {
  explicit ProbeBlockImpl(int i)
      : in(register_module("in", torch::nn::Linear(kDim, 8 * (i + 1)))),
        out(register_module("out", torch::nn::Linear(8 * (i + 1), kDim))), index(i) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in->forward(x);
    if (probe) {
      probe(index);
    }
    at::Tensor y = out->forward(torch::relu(h));
    return fail_backward ? ThrowInBackward::apply(y) : y;
  }
  torch::nn::Linear in, out;
  int index;
  std::function<void(int)> probe;
  bool fail_backward = false;
};
TORCH_MODULE(ProbeBlock);

struct Model {
  torch::nn::Sequential seq;
  std::vector<ProbeBlock> blocks;
  std::vector<FSDPModule> units;
  FSDPModule root;
};

// Four blocks, each a unit; the root (the Sequential) holds no parameters of its own.
Model make_model(bool overlap) {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  Model m;
  torch::manual_seed(0);
  for (int i = 0; i < kBlocks; ++i) {
    m.blocks.emplace_back(i);
    m.blocks.back()->to(options().device());
    m.seq->push_back(m.blocks.back());
  }
  for (auto& b : m.blocks) {
    m.units.push_back(dtensor::fully_shard(*b, FullyShardOptions().mesh(dp)));
  }
  m.root = dtensor::fully_shard(*m.seq, FullyShardOptions().mesh(dp));
  m.root.set_communication_overlap(overlap);
  return m;
}

at::Tensor batch(int step, int r = rank()) {
  at::manual_seed(500 + 13 * step + r);
  return at::randn({6, kDim}, options());
}

// The reference: the same blocks, plain, trained on every rank's batch (the data-parallel
// gradient is the mean of the ranks' gradients).
struct Plain {
  torch::nn::Sequential seq;
  std::unique_ptr<torch::optim::SGD> opt;
};

Plain make_plain() {
  Plain p;
  torch::manual_seed(0);
  for (int i = 0; i < kBlocks; ++i) {
    ProbeBlock b(i);
    b->to(options().device());
    p.seq->push_back(b);
  }
  p.opt = std::make_unique<torch::optim::SGD>(p.seq->parameters(), 0.1);
  return p;
}

void plain_step(Plain& p, int step) {
  p.opt->zero_grad();
  at::Tensor loss = at::zeros({}, options());
  for (int r = 0; r < world(); ++r) {
    loss = loss + p.seq->forward(batch(step, r)).pow(2).sum();
  }
  (loss / world()).backward();
  p.opt->step();
}

at::Tensor loss_of(Model& m, int step) { return m.seq->forward(batch(step)).pow(2).sum(); }

// Which block a record is: all-gathers hand the flat shard in, reduce-scatters world
// copies of it.
int block_of(const CollectiveRecord& r, const std::map<int64_t, int>& by_numel) {
  int64_t numel = r.shape.at(0);
  if (r.kind == CollectiveKind::ReduceScatter) {
    numel /= world();
  }
  return by_numel.at(numel);
}

struct StepLog {
  std::vector<int64_t> gathers_at_probe; // all-gathers issued when block i's first op ended
  std::vector<CollectiveRecord> forward, backward;
  int64_t peak = 0; // fsdp_memory_stats().peak_bytes during the step
};

StepLog run_step(Model& m, int step, torch::optim::SGD& opt) {
  StepLog log;
  opt.zero_grad();
  dtensor::reset_fsdp_peak_memory();
  CommDebugMode mode;
  for (auto& b : m.blocks) {
    b->probe = [&](int) { log.gathers_at_probe.push_back(mode.count(CollectiveKind::AllGather)); };
  }
  at::Tensor loss = loss_of(m, step);
  log.forward = mode.records();
  mode.reset();
  loss.backward();
  log.backward = mode.records();
  log.peak = dtensor::fsdp_memory_stats().peak_bytes;
  for (auto& b : m.blocks) {
    b->probe = nullptr;
  }
  opt.step();
  return log;
}

} // namespace

TEST_CASE("fsdp overlap: the next unit's all-gather is issued while this one computes",
          "[fsdp_overlap][world2][world4]") {
  Model on = make_model(true);
  Model off = make_model(false);
  Plain plain = make_plain();
  torch::optim::SGD opt_on(on.seq->parameters(), 0.1);
  torch::optim::SGD opt_off(off.seq->parameters(), 0.1);

  // Step 0 records the order; nothing to prefetch yet in forward.
  StepLog first = run_step(on, 0, opt_on);
  run_step(off, 0, opt_off);
  plain_step(plain, 0);
  REQUIRE(first.gathers_at_probe == std::vector<int64_t>{1, 2, 3, 4});
  std::map<int64_t, int> by_numel; // flat shard numel -> block, from the first forward
  for (size_t i = 0; i < first.forward.size(); ++i) {
    by_numel[first.forward[i].shape.at(0)] = static_cast<int>(i);
  }
  REQUIRE(by_numel.size() == kBlocks);

  for (int step = 1; step < 3; ++step) {
    INFO("step " << step);
    StepLog a = run_step(on, step, opt_on);
    StepLog b = run_step(off, step, opt_off);
    plain_step(plain, step);
    // Forward: when block i's first op is done, block i + 1 is being gathered already.
    REQUIRE(a.gathers_at_probe == std::vector<int64_t>{2, 3, 4, 4});
    REQUIRE(b.gathers_at_probe == std::vector<int64_t>{1, 2, 3, 4});
    for (size_t i = 0; i < a.forward.size(); ++i) {
      REQUIRE(block_of(a.forward[i], by_numel) == static_cast<int>(i));
      REQUIRE(a.forward[i].async == (i > 0)); // the prefetches run in the background
    }
    // Backward: block i - 1's all-gather is issued before block i's reduce-scatter, i.e.
    // before block i's gradients are complete; the reduce-scatters run in the background.
    std::map<std::pair<CollectiveKind, int>, size_t> at;
    for (size_t i = 0; i < a.backward.size(); ++i) {
      at[{a.backward[i].kind, block_of(a.backward[i], by_numel)}] = i;
      if (a.backward[i].kind == CollectiveKind::ReduceScatter) {
        REQUIRE(a.backward[i].async);
      }
    }
    for (int i = kBlocks - 1; i > 0; --i) {
      INFO("block " << i);
      REQUIRE(at.count({CollectiveKind::AllGather, i - 1}) == 1);
      REQUIRE(at[{CollectiveKind::AllGather, i - 1}] < at[{CollectiveKind::ReduceScatter, i}]);
    }
    // Same collectives, same sizes, with overlap on and off.
    REQUIRE(a.forward.size() == b.forward.size());
    REQUIRE(a.backward.size() == b.backward.size());
    auto kinds = [](const std::vector<CollectiveRecord>& rs, CollectiveKind k) {
      return std::count_if(rs.begin(), rs.end(), [&](const auto& r) { return r.kind == k; });
    };
    for (auto k : {CollectiveKind::AllGather, CollectiveKind::ReduceScatter}) {
      REQUIRE(kinds(a.backward, k) == kinds(b.backward, k));
    }
    REQUIRE(kinds(a.backward, CollectiveKind::AllGather) == kBlocks - 1); // the last stays
    REQUIRE(kinds(a.backward, CollectiveKind::ReduceScatter) == kBlocks);
  }
  // The same training: gradients and parameters identical with overlap on and off, and
  // equal to the plain model's trained on every rank's batch.
  auto p = on.seq->parameters();
  auto q = off.seq->parameters();
  auto ref = plain.seq->parameters();
  REQUIRE(p.size() == q.size());
  REQUIRE(p.size() == ref.size());
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(same(full_value(p[i].grad()), full_value(q[i].grad())));
    REQUIRE(same(full_value(p[i]), full_value(q[i])));
    REQUIRE(close(full_value(p[i].grad()), ref[i].grad()));
    REQUIRE(close(full_value(p[i]), ref[i]));
  }
}

TEST_CASE("fsdp overlap: memory stays within the bound of docs/fsdp.md",
          "[fsdp_overlap][world2][world4]") {
  Model on = make_model(true);
  torch::optim::SGD opt(on.seq->parameters(), 0.1);
  run_step(on, 0, opt);
  StepLog s = run_step(on, 1, opt);
  // Bound: the units kept unsharded (none here: the root has no parameters) + the unit in
  // use and the prefetched one (each at most the largest all-gather output) + at most
  // kMaxReducesInFlight = 1 reduce-scatter input in flight.
  int64_t max_gather = 0;
  int64_t max_reduce = 0;
  for (const auto& r : s.forward) {
    max_gather = std::max(max_gather, r.bytes_out);
  }
  for (const auto& r : s.backward) {
    if (r.kind == CollectiveKind::ReduceScatter) {
      max_reduce = std::max(max_reduce, r.bytes_in);
    }
  }
  const int64_t bound = 2 * max_gather + max_reduce;
  INFO("peak " << s.peak << " bound " << bound);
  REQUIRE(s.peak <= bound);
  REQUIRE(s.peak >= max_gather); // non-vacuous: at least one unit was unsharded
  // Nothing is left unsharded or in flight after the step (the root has no parameters, and
  // every unit reshards after backward).
  REQUIRE(dtensor::fsdp_memory_stats().unsharded_bytes == 0);
  REQUIRE(dtensor::fsdp_memory_stats().communication_bytes == 0);
  for (auto& u : on.units) {
    REQUIRE_FALSE(u.is_unsharded());
  }
}

TEST_CASE("fsdp overlap: a failed backward leaves nothing in flight for the next one",
          "[fsdp_overlap][world1][world2][world4]") {
  // [Note: failed backward]: blocks 3..1 run their backward (reduce-scatters in flight,
  // block 0 prefetched), then block 0's output node throws on every rank.
  Model a = make_model(true);
  Model ref = make_model(true);
  torch::optim::SGD opt_a(a.seq->parameters(), 0.1);
  torch::optim::SGD opt_ref(ref.seq->parameters(), 0.1);
  run_step(a, 0, opt_a);
  run_step(ref, 0, opt_ref);
  a.blocks[0]->fail_backward = true;
  opt_a.zero_grad();
  REQUIRE_THROWS_WITH(loss_of(a, 1).backward(), contains("injected backward failure"));
  a.blocks[0]->fail_backward = false;
  // The next step equals a step of a model that never failed: the same backward
  // collectives, gradients and parameters. (Its forward may find block 0 gathered already:
  // the failed backward's prefetch is still valid.)
  StepLog sa = run_step(a, 1, opt_a);
  StepLog sr = run_step(ref, 1, opt_ref);
  REQUIRE(sa.forward.size() <= sr.forward.size());
  REQUIRE(sa.backward.size() == sr.backward.size());
  for (size_t i = 0; i < sa.backward.size(); ++i) {
    REQUIRE(sa.backward[i].kind == sr.backward[i].kind);
    REQUIRE(sa.backward[i].shape == sr.backward[i].shape);
  }
  auto p = a.seq->parameters();
  auto q = ref.seq->parameters();
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(same(full_value(p[i].grad()), full_value(q[i].grad())));
    REQUIRE(same(full_value(p[i]), full_value(q[i])));
  }
  REQUIRE(dtensor::fsdp_memory_stats().communication_bytes == 0);
}

TEST_CASE("replicate: a failed backward does not leave its buckets half counted",
          "[fsdp_overlap][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto make = [&](std::vector<ProbeBlock>& blocks) {
    torch::manual_seed(0);
    torch::nn::Sequential seq;
    for (int i = 0; i < 2; ++i) {
      blocks.emplace_back(i);
      blocks.back()->to(options().device());
      seq->push_back(blocks.back());
    }
    // Tiny buckets: one per parameter or two, so some are reduced before the failure.
    auto handle = dtensor::replicate(*seq, dp, dtensor::ReplicateOptions().bucket_cap_mb(1e-4));
    return std::make_pair(seq, handle);
  };
  std::vector<ProbeBlock> blocks_a, blocks_ref;
  auto [a, handle_a] = make(blocks_a);
  auto [ref, handle_ref] = make(blocks_ref);
  blocks_a[0]->fail_backward = true;
  REQUIRE_THROWS_WITH(a->forward(batch(0)).pow(2).sum().backward(),
                      contains("injected backward failure"));
  blocks_a[0]->fail_backward = false;
  for (auto& m : {a, ref}) {
    for (auto& p : m->parameters()) {
      p.mutable_grad() = at::Tensor();
    }
  }
  CommDebugMode mode_a;
  a->forward(batch(1)).pow(2).sum().backward();
  const int64_t count_a = mode_a.count(CollectiveKind::AllReduce);
  mode_a.reset();
  ref->forward(batch(1)).pow(2).sum().backward();
  REQUIRE(count_a == mode_a.count(CollectiveKind::AllReduce));
  auto p = a->parameters();
  auto q = ref->parameters();
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(same(p[i].grad(), q[i].grad()));
  }
}
