// FSDP2's controls: unshard(async_op) with its handle, set_requires_all_reduce
// (HSDP accumulation), set_is_last_backward (microbatching), set_unshard_in_backward
// (embeddings), the mixed-precision casts of units called through dtensor::call
// (cast_forward_inputs, output_dtype), independent roots' own queues,
// OffloadPolicy::pin_memory, set_post_optim_event, post-accumulate-grad hooks (optimizer
// in backward). Judged against the plain model on one process (every rank computes it on
// every rank's batch) and by exact collective counts.
#include <map>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"
#include <models/mlp_models.h>

using dtensor::FSDPModule;

namespace {

constexpr int64_t kDim = 5; // MLPStack widths 15 and 20: uneven over 2 and 4 ranks

at::Tensor batch(int r, int step) {
  at::manual_seed(4000 + 31 * step + r);
  return at::randn({4, kDim}, options());
}

at::Tensor loss_of(torch::nn::Sequential& m, const at::Tensor& x) {
  return m->forward(x).pow(2).sum();
}

// MLPStack (3 MLP units and the root with its LayerNorm), and the plain model.
struct Job {
  torch::nn::Sequential model;
  std::vector<FSDPModule> blocks;
  FSDPModule root;
  torch::nn::Sequential plain;
};

Job make_job(const FullyShardOptions& opts) {
  Job j;
  torch::manual_seed(0);
  j.model = dtensor::models::mlp_stack(kDim, /*with_seq_parallel=*/true);
  torch::manual_seed(0);
  j.plain = dtensor::models::mlp_stack(kDim, true);
  j.model->to(options().device());
  j.plain->to(options().device());
  for (size_t i = 0; i < 3; ++i) {
    j.blocks.push_back(dtensor::fully_shard(*j.model[i], opts));
  }
  j.root = dtensor::fully_shard(*j.model, opts);
  return j;
}

// The plain model's gradients for microbatch `step`: the mean over every rank's batch (what
// fully_shard's averaging reduction gives), accumulated into its .grad.
void plain_backward(Job& j, int step) {
  for (int r = 0; r < world(); ++r) {
    (loss_of(j.plain, batch(r, step)) / world()).backward();
  }
}

void require_grads_match(Job& j) {
  auto p = j.model->parameters();
  auto q = j.plain->parameters();
  REQUIRE(p.size() == q.size());
  for (size_t i = 0; i < p.size(); ++i) {
    INFO("grad " << i);
    REQUIRE(p[i].grad().defined());
    REQUIRE(close(full_value(p[i].grad()), q[i].grad()));
  }
}

} // namespace

TEST_CASE("fsdp controls: unshard(async_op) returns a handle; forward uses what it gathered",
          "[fsdp_controls][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  for (bool overlap : {true, false}) {
    INFO("overlap " << overlap);
    Job j = make_job(FullyShardOptions().mesh(dp));
    j.root.set_communication_overlap(overlap);
    for (int step = 0; step < 2; ++step) {
      REQUIRE_FALSE(j.blocks[1].is_unsharded());
      dtensor::UnshardHandle handle;
      {
        CommDebugMode mode;
        handle = j.blocks[1].unshard(/*async_op=*/true);
        REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 1));
      }
      if (step == 0) {
        handle.wait(); // step 1: forward waits for it
        REQUIRE((j.blocks[1].unsharded_storage_bytes() > 0) == (world() > 1));
        handle.wait(); // twice: nothing more
      }
      at::Tensor loss;
      {
        CommDebugMode fwd;
        loss = loss_of(j.model, batch(rank(), step));
        REQUIRE(fwd.count(CollectiveKind::AllGather) == over(world(), 3)); // the root and blocks 0 and 2
      }
      loss.backward();
      plain_backward(j, step);
      require_grads_match(j);
      j.model->zero_grad();
      j.plain->zero_grad();
    }
  }
}

TEST_CASE("fsdp controls: set_requires_all_reduce(false) reduce-scatters each microbatch and "
          "all-reduces the sum once",
          "[fsdp_controls][world2][world4]") {
  auto hsdp = init_device_mesh(device_type(), {2, world() / 2}, {"replicate", "shard"});
  Job j = make_job(FullyShardOptions().mesh(hsdp));
  const int64_t units = 4;
  const int microbatches = 3;
  for (int mb = 0; mb < microbatches; ++mb) {
    INFO("microbatch " << mb);
    const bool last = mb == microbatches - 1;
    j.root.set_requires_all_reduce(last);
    CommDebugMode mode;
    loss_of(j.model, batch(rank(), mb)).backward();
    REQUIRE(mode.count("shard", CollectiveKind::ReduceScatter) == over(hsdp.size(1), units));
    REQUIRE(mode.count("replicate", CollectiveKind::AllReduce) == (last ? units : 0));
    if (!last) { // the reduced shards wait inside the units: .grad untouched
      for (const auto& p : j.model->parameters()) {
        REQUIRE_FALSE(p.grad().defined());
      }
    }
    plain_backward(j, mb);
  }
  require_grads_match(j);
  // set_requires_gradient_sync(true) turns the all-reduce back on too (FSDP2).
  j.model->zero_grad();
  j.plain->zero_grad();
  j.root.set_requires_all_reduce(false);
  j.root.set_requires_gradient_sync(true);
  CommDebugMode mode;
  loss_of(j.model, batch(rank(), 7)).backward();
  REQUIRE(mode.count("replicate", CollectiveKind::AllReduce) == units);
  plain_backward(j, 7);
  require_grads_match(j);
}

TEST_CASE("fsdp controls: set_is_last_backward(false) for microbatches, true for the last",
          "[fsdp_controls][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  Job j = make_job(FullyShardOptions().mesh(dp));
  const int microbatches = 3;
  for (int mb = 0; mb < microbatches; ++mb) {
    INFO("microbatch " << mb);
    const bool last = mb == microbatches - 1;
    j.blocks[2].set_is_last_backward(last); // any unit: its root's model
    CommDebugMode mode;
    loss_of(j.model, batch(rank(), mb)).backward();
    REQUIRE(mode.count(CollectiveKind::ReduceScatter) == over(world(), 4));
    if (last || world() == 1) { // every reduce-scatter is complete (none on one rank)
      REQUIRE(dtensor::fsdp_memory_stats().communication_bytes == 0);
    } else { // the last one issued is in flight; its input is held where the backend reads
      // it until completion: NCCL, and Gloo's all-to-all over 2+ ranks ([Note: Gloo's
      // reduce-scatter as an all-to-all] in lib/mesh/collectives.cpp). Its output becomes
      // .grad's storage.
      const dtensor::CollectiveRecord& rs = mode.records().back();
      REQUIRE(rs.kind == CollectiveKind::ReduceScatter);
      REQUIRE(rs.async);
      REQUIRE(rs.bytes_in > 0);
      REQUIRE(dtensor::fsdp_memory_stats().communication_bytes == rs.bytes_in);
    }
    plain_backward(j, mb);
  }
  require_grads_match(j);
}

TEST_CASE("fsdp controls: independent roots keep their own reduce queues and end-of-backward",
          "[fsdp_controls][world2][world4]") {
  // [Note: per-root context] in lib/parallel/fsdp/fsdp_state.h. A leaves a reduce-scatter in flight
  // (set_is_last_backward(false)); B's backward, which waits for its own, must not finish
  // A's (it did when one queue served every root): A's input buffer is still held after it.
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  Job a = make_job(FullyShardOptions().mesh(dp));
  Job b = make_job(FullyShardOptions().mesh(dp));
  a.root.set_is_last_backward(false);
  int64_t a_in_flight = 0;
  {
    CommDebugMode mode;
    loss_of(a.model, batch(rank(), 0)).backward();
    a_in_flight = mode.records().back().bytes_in;
  }
  plain_backward(a, 0);
  REQUIRE(a_in_flight > 0);
  REQUIRE(dtensor::fsdp_memory_stats().communication_bytes == a_in_flight);
  {
    CommDebugMode mode;
    loss_of(b.model, batch(rank(), 0)).backward();
    REQUIRE(mode.count(CollectiveKind::ReduceScatter) == 4); // B's units only
  }
  plain_backward(b, 0);
  REQUIRE(dtensor::fsdp_memory_stats().communication_bytes == a_in_flight);
  require_grads_match(b);
  // One backward through both roots: each root's callback finishes its own units.
  a.root.set_is_last_backward(true);
  {
    CommDebugMode mode;
    (loss_of(a.model, batch(rank(), 1)) + loss_of(b.model, batch(rank(), 1))).backward();
    REQUIRE(mode.count(CollectiveKind::ReduceScatter) == 8);
  }
  plain_backward(a, 1);
  plain_backward(b, 1);
  REQUIRE(dtensor::fsdp_memory_stats().communication_bytes == 0);
  require_grads_match(a);
  require_grads_match(b);
}

namespace {

// Token embedding -> Linear, each its own unit, and the root (no parameters of its own).
struct EmbedLinearImpl : torch::nn::Module {
  EmbedLinearImpl()
      : emb(register_module("emb", torch::nn::Embedding(16, 8))),
        lin(register_module("lin", torch::nn::Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& tokens) { return lin(emb(tokens)); }
  torch::nn::Embedding emb;
  torch::nn::Linear lin;
};
TORCH_MODULE(EmbedLinear);

at::Tensor tokens(int step) {
  at::manual_seed(77 + step);
  return at::randint(16, {4, 6}, options(at::kLong));
}

} // namespace

TEST_CASE("fsdp controls: set_unshard_in_backward(false) skips the embedding's backward "
          "all-gather",
          "[fsdp_controls][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  for (bool unshard : {true, false}) {
    INFO("unshard_in_backward " << unshard);
    torch::manual_seed(1);
    EmbedLinear model;
    torch::manual_seed(1);
    EmbedLinear plain;
    model->to(options().device());
    plain->to(options().device());
    auto emb = dtensor::fully_shard(*model->emb, FullyShardOptions().mesh(dp));
    dtensor::fully_shard(*model->lin, FullyShardOptions().mesh(dp));
    dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
    emb.set_unshard_in_backward(unshard);
    for (int step = 0; step < 2; ++step) {
      at::Tensor loss = model->forward(tokens(step)).pow(2).sum();
      CommDebugMode bwd;
      loss.backward();
      // lin's backward prefetches the embedding (the unit before it) unless told not to;
      // lin itself is still unsharded (the last unit of forward).
      REQUIRE(bwd.count(CollectiveKind::AllGather) == over(world(), unshard ? 1 : 0));
      REQUIRE(bwd.count(CollectiveKind::ReduceScatter) == over(world(), 2));
    }
    for (int step = 0; step < 2; ++step) {
      plain->forward(tokens(step)).pow(2).sum().backward();
    }
    auto p = model->parameters();
    auto q = plain->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("grad " << i);
      REQUIRE(close(full_value(p[i].grad()), q[i].grad()));
    }
  }
}

TEST_CASE("fsdp controls: a unit whose backward reads its parameters cannot skip the unshard",
          "[fsdp_controls][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
  model->to(options().device());
  auto first = dtensor::fully_shard(*model[0], FullyShardOptions().mesh(dp));
  dtensor::fully_shard(*model[1], FullyShardOptions().mesh(dp));
  dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  auto second = dtensor::fsdp_module(*model[1]);
  REQUIRE(second.has_value());
  second->set_unshard_in_backward(false);
  auto x = at::randn({4, 8}, options());
  auto loss = model->forward(x).sum();
  // model[1] is still unsharded after forward (forward ended in it), so its backward needs
  // no all-gather; model[0]'s does. Reshard model[1] to make backward read a freed unit.
  second->reshard();
  // The second layer's backward reads its weight (for the input's gradient).
  REQUIRE_THROWS_WITH(loss.backward(),
                      contains("backward reads its parameters, but the unit was set not to "
                               "unshard in backward (set_unshard_in_backward(false))"));
  (void)first;
}

TEST_CASE("fsdp controls: a unit called through dtensor::call casts inputs to param_dtype and "
          "outputs to output_dtype",
          "[fsdp_controls][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  auto mp = dtensor::MixedPrecisionPolicy()
                .param_dtype(at::kBFloat16)
                .reduce_dtype(at::kFloat)
                .output_dtype(at::kFloat);
  Job j = make_job(FullyShardOptions().mesh(dp).mp_policy(mp));
  // The reference: the plain model in bf16 on the input cast to bf16, its output cast back.
  torch::manual_seed(0);
  auto low = dtensor::models::mlp_stack(kDim, true);
  low->to(options().device());
  low->to(at::kBFloat16);
  const at::Tensor x = batch(rank(), 0); // fp32
  // Called directly, fp32 inputs meet bf16 parameters: refused, naming the way out.
  REQUIRE_THROWS_WITH(j.model->forward(x), contains("dtensor::call"));
  at::Tensor out = dtensor::call(j.model, x);
  REQUIRE(out.scalar_type() == at::kFloat);
  at::Tensor ref = low->forward(x.to(at::kBFloat16)).to(at::kFloat);
  REQUIRE(close(out, ref, 1e-2, 1e-2));
  // The casts are differentiable: the input's gradient comes back in fp32.
  at::Tensor xg = x.clone().requires_grad_(true);
  dtensor::call(j.model, xg).pow(2).sum().backward();
  REQUIRE(xg.grad().scalar_type() == at::kFloat);
  for (const auto& p : j.model->parameters()) {
    REQUIRE(p.grad().scalar_type() == at::kFloat); // stored in the parameters' dtype
  }
  // cast_forward_inputs(false): call leaves the inputs alone (and so is refused).
  Job k = make_job(FullyShardOptions().mesh(dp).mp_policy(
      dtensor::MixedPrecisionPolicy().param_dtype(at::kBFloat16).cast_forward_inputs(false)));
  REQUIRE_THROWS_WITH(dtensor::call(k.model, x), contains("mp_policy.param_dtype"));
  // Without output_dtype the output stays in param_dtype; a module that is not a unit runs
  // unchanged.
  REQUIRE(dtensor::call(k.model, x.to(at::kBFloat16)).scalar_type() == at::kBFloat16);
  torch::nn::Linear plain(kDim, 3);
  plain->to(options().device());
  REQUIRE(dtensor::call(plain, x).scalar_type() == at::kFloat);
  // fsdp_forward is an alias of call.
  REQUIRE(dtensor::fsdp_forward(j.model, x).scalar_type() == at::kFloat);
}

TEST_CASE("fsdp controls: OffloadPolicy pin_memory needs offload and a CUDA device",
          "[fsdp_controls][world1]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  torch::nn::Linear a(4, 4);
  REQUIRE_THROWS_WITH(dtensor::fully_shard(*a, FullyShardOptions().mesh(dp).offload_policy(
                                                   dtensor::OffloadPolicy().pin_memory(true))),
                      contains("pin_memory(true) without offload_to_cpu(true)"));
  torch::nn::Linear b(4, 4);
  b->to(options().device());
  auto policy = dtensor::OffloadPolicy().offload_to_cpu(true).pin_memory(true);
  if (!at::globalContext().hasCUDA()) { // the CPU analogue: refused, naming what is missing
    REQUIRE_THROWS_WITH(
        dtensor::fully_shard(*b, FullyShardOptions().mesh(dp).offload_policy(policy)),
        contains("needs a CUDA device to pin the offloaded shards for"));
    return;
  }
  dtensor::fully_shard(*b, FullyShardOptions().mesh(dp).offload_policy(policy));
  for (const auto& p : b->parameters()) { // the GPU path: page-locked shards
    REQUIRE(DTensor(p).to_local().is_pinned());
  }
}

TEST_CASE("fsdp controls: set_post_optim_event is consumed by the next forward",
          "[fsdp_controls][world1][world2]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  Job j = make_job(FullyShardOptions().mesh(dp));
  // The CPU analogue (no streams): the event is kept until the next forward, which takes
  // it once; counts and values are unaffected. On a cuda mesh the stream would wait for it.
  j.blocks[0].set_post_optim_event(c10::Event(device_type()));
  REQUIRE(j.root.has_post_optim_event()); // any unit: its root's model
  CommDebugMode fwd;
  auto loss = loss_of(j.model, batch(rank(), 0));
  REQUIRE(fwd.count(CollectiveKind::AllGather) == over(world(), 4));
  REQUIRE_FALSE(j.root.has_post_optim_event());
  loss.backward();
  plain_backward(j, 0);
  require_grads_match(j);
  // (A meta event stands for a foreign device on a CPU-only build, which has no CUDA events.)
  const c10::DeviceType other = device_type() == c10::kCPU ? c10::kMeta : c10::kCPU;
  REQUIRE_THROWS_WITH(j.root.set_post_optim_event(c10::Event(other)),
                      contains("set_post_optim_event: the event is a"));
}

TEST_CASE("fsdp controls: post-accumulate-grad hooks run once .grad is reduced "
          "(optimizer in backward)",
          "[fsdp_controls][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  Job j = make_job(FullyShardOptions().mesh(dp));
  // Optimizer in backward: each parameter takes its SGD step and drops its gradient as soon
  // as it is final. The reference: the plain model, SGD after backward.
  const double lr = 0.1;
  std::map<const c10::TensorImpl*, int> calls;
  for (auto& p : j.model->parameters()) {
    dtensor::register_post_accumulate_grad_hook(p, [&calls, lr](const at::Tensor& param) {
      ++calls[param.unsafeGetTensorImpl()];
      REQUIRE(DTensor(param.grad()).placements() == Placements{dtensor::Shard(0)});
      at::NoGradGuard no_grad;
      at::Tensor(param).sub_(param.grad(), lr);
      at::Tensor(param).mutable_grad() = at::Tensor();
    });
  }
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    calls.clear();
    loss_of(j.model, batch(rank(), step)).backward();
    plain_backward(j, step);
    {
      at::NoGradGuard no_grad;
      for (auto& q : j.plain->parameters()) {
        q.sub_(q.grad(), lr);
      }
    }
    j.plain->zero_grad();
    auto p = j.model->parameters();
    auto q = j.plain->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("param " << i);
      REQUIRE(calls[p[i].unsafeGetTensorImpl()] == 1);
      REQUIRE_FALSE(p[i].grad().defined()); // freed in the hook
      REQUIRE(close(full_value(p[i]), q[i]));
    }
  }
  // No hook in a backward that leaves .grad alone (no gradient sync).
  calls.clear();
  j.root.set_requires_gradient_sync(false);
  loss_of(j.model, batch(rank(), 9)).backward();
  REQUIRE(calls.empty());
  // A plain parameter's hooks run too (LibTorch's accumulator), in registration order.
  torch::nn::Linear plain(3, 2);
  std::vector<int> order;
  dtensor::register_post_accumulate_grad_hook(plain->weight, [&](const at::Tensor& w) {
    REQUIRE(w.grad().defined());
    order.push_back(1);
  });
  dtensor::register_post_accumulate_grad_hook(plain->weight,
                                              [&](const at::Tensor&) { order.push_back(2); });
  plain->forward(at::ones({1, 3})).sum().backward();
  REQUIRE(order == std::vector<int>{1, 2});
  REQUIRE_THROWS_WITH(dtensor::register_post_accumulate_grad_hook(at::ones({2}), [](auto&) {}),
                      contains("must be a leaf that requires grad"));
}

namespace {

// Tied embedding and output projection (torchtitan's weight tying): tok -> blocks -> out,
// out's weight is tok's weight, registered in both modules (one tensor, two names).
struct TiedOutImpl : torch::nn::Module {
  explicit TiedOutImpl(const at::Tensor& tied) : weight(register_parameter("weight", tied)) {}
  at::Tensor forward(const at::Tensor& x) { return x.matmul(weight.t()); }
  at::Tensor weight;
};
TORCH_MODULE(TiedOut);

struct TiedImpl : torch::nn::Module {
  TiedImpl()
      : tok(register_module("tok", torch::nn::Embedding(12, 8))),
        blocks(register_module(
            "blocks", torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)))),
        out(register_module("out", TiedOut(tok->weight))) {}
  at::Tensor forward(const at::Tensor& tokens) { return out(blocks->forward(tok(tokens))); }
  torch::nn::Embedding tok;
  torch::nn::Sequential blocks;
  TiedOut out;
};
TORCH_MODULE(Tied);

} // namespace

TEST_CASE("fsdp controls: fully_shard over a group of modules manages a tied weight once",
          "[fsdp_controls][world1][world2][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  torch::manual_seed(5);
  Tied model;
  torch::manual_seed(5);
  Tied plain;
  model->to(options().device());
  plain->to(options().device());
  REQUIRE(model->out->weight.is_same(model->tok->weight));
  for (auto& block : model->blocks->children()) {
    dtensor::fully_shard(*block, FullyShardOptions().mesh(dp));
  }
  auto ends =
      dtensor::fully_shard({model->tok.ptr(), model->out.ptr()}, FullyShardOptions().mesh(dp));
  auto root = dtensor::fully_shard(*model, FullyShardOptions().mesh(dp));
  REQUIRE(ends.managed_parameters().size() == 1); // the tied weight, once
  REQUIRE(dtensor::fsdp_module(*model->out)->managed_parameters()[0].is_same(model->tok->weight));
  REQUIRE(model->out->weight.is_same(model->tok->weight)); // still tied
  REQUIRE(root.managed_parameters().empty());
  // (LibTorch's parameters() lists a tied tensor under both names: once each here.)
  auto unique = [](const std::vector<at::Tensor>& ps) {
    std::vector<at::Tensor> out;
    for (const auto& p : ps) {
      if (std::none_of(out.begin(), out.end(), [&](const at::Tensor& o) { return o.is_same(p); })) {
        out.push_back(p);
      }
    }
    return out;
  };
  torch::optim::SGD opt(unique(model->parameters()), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(unique(plain->parameters()), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    auto loss_fn = [&](Tied& m, int r) {
      at::manual_seed(300 + 7 * step + r);
      return m->forward(at::randint(12, {3, 5}, options(at::kLong))).pow(2).mean();
    };
    CommDebugMode mode;
    loss_fn(model, rank()).backward();
    // Forward: the group at tok, resharded when forward moves to the blocks, gathered again
    // at out (2), and the blocks (2); backward: the blocks again (out's backward finds the
    // group still unsharded). The tied weight's gradient (both uses summed) is reduced once.
    REQUIRE(mode.count(CollectiveKind::AllGather) == over(world(), 4 + 2));
    REQUIRE(mode.count(CollectiveKind::ReduceScatter) == over(world(), 3));
    for (int r = 0; r < world(); ++r) {
      (loss_fn(plain, r) / world()).backward();
    }
    auto p = model->parameters();
    auto q = plain->parameters();
    REQUIRE(p.size() == q.size());
    for (size_t i = 0; i < p.size(); ++i) {
      INFO("grad " << i);
      REQUIRE(close(full_value(p[i].grad()), q[i].grad()));
    }
    opt.step();
    ref_opt.step();
    opt.zero_grad();
    ref_opt.zero_grad();
    for (size_t i = 0; i < p.size(); ++i) {
      REQUIRE(close(full_value(p[i]), q[i]));
    }
  }
  torch::nn::Linear lone(2, 2);
  REQUIRE_THROWS_WITH(dtensor::fully_shard({lone.ptr(), lone.ptr()}), contains("is listed twice"));
  REQUIRE_THROWS_WITH(dtensor::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{}),
                      contains("the list of modules to group is empty"));
}

namespace {

// A unit's padded flat shard, in elements: per parameter ceil(dim0 / S) rows (torch.chunk).
int64_t flat_shard_numel(const FSDPModule& unit, int64_t shard_size) {
  int64_t n = 0;
  for (const auto& p : unit.managed_parameters()) {
    const auto shape = p.sizes().vec(); // a DTensor's sizes are the global ones
    const int64_t rows = shape[0];
    const int64_t row_numel = rows == 0 ? 0 : c10::multiply_integers(shape) / rows;
    n += (rows + shard_size - 1) / shard_size * row_numel;
  }
  return n;
}

} // namespace

TEST_CASE("fsdp controls: reshard_after_forward as an int reshards to a smaller group",
          "[fsdp_controls][world4]") {
  auto dp = init_device_mesh(device_type(), {world()}, {"dp"});
  const int64_t S = world();
  for (int k : {2, 1, 4}) {
    INFO("reshard_after_forward " << k);
    Job j = make_job(FullyShardOptions().mesh(dp).reshard_after_forward(k));
    torch::optim::SGD opt(j.model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(j.plain->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      // (Relative: earlier cases' units may still hold unsharded bytes in this process.)
      const int64_t before = dtensor::fsdp_memory_stats().unsharded_bytes;
      at::Tensor loss;
      {
        CommDebugMode fwd;
        loss = loss_of(j.model, batch(rank(), step));
        REQUIRE(fwd.count("dp", CollectiveKind::AllGather) == 4);
      }
      // After forward each block keeps S / k of its flat shards (k = 2: two of four), the
      // root stays unsharded; k = 1: blocks stay whole; k = S: nothing kept.
      int64_t expected = j.root.unsharded_storage_bytes();
      for (auto& b : j.blocks) {
        const int64_t kept = k == 1 ? b.unsharded_storage_bytes() : 0;
        REQUIRE((kept > 0) == (k == 1));
        expected += k == 2 ? (S / k) * flat_shard_numel(b, S) * 4 : kept;
      }
      REQUIRE(dtensor::fsdp_memory_stats().unsharded_bytes - before == expected);
      CommDebugMode bwd;
      loss.backward();
      if (k == 2) { // backward gathers the blocks over pairs of ranks, with S / k shards each
        REQUIRE(bwd.count("post_forward", CollectiveKind::AllGather) == 3);
        REQUIRE(bwd.count("dp", CollectiveKind::AllGather) == 0);
        size_t b = 3;
        for (const auto& rec : bwd.records()) {
          if (rec.group == "post_forward") {
            --b;
            REQUIRE(rec.ranks == std::vector<int>{rank() / 2 * 2, rank() / 2 * 2 + 1});
            REQUIRE(rec.bytes_in == (S / k) * flat_shard_numel(j.blocks[b], S) * 4);
          }
        }
      } else {
        REQUIRE(bwd.count(CollectiveKind::AllGather) == (k == S ? 3 : 0));
      }
      REQUIRE(bwd.count("dp", CollectiveKind::ReduceScatter) == 4); // over all S ranks
      REQUIRE(dtensor::fsdp_memory_stats().unsharded_bytes == before);
      plain_backward(j, step);
      require_grads_match(j);
      opt.step();
      ref_opt.step();
      opt.zero_grad();
      ref_opt.zero_grad();
    }
    auto p = j.model->parameters();
    auto q = j.plain->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      REQUIRE(close(full_value(p[i]), q[i]));
    }
  }
  torch::nn::Linear lin(4, 4);
  lin->to(options().device());
  REQUIRE_THROWS_WITH(
      dtensor::fully_shard(*lin, FullyShardOptions().mesh(dp).reshard_after_forward(3)),
      contains("a factor of the shard dim's size 4; got 3"));
}
