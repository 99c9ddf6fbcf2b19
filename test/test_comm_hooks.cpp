// PyTorch's test_fsdp_comm_hooks.py in per-parameter terms: register_comm_hook on the root of
// fully_shard units and on replicate's handle (registration, its errors, the hook's values),
// the fp16 / bf16 compression hooks against mp_policy.reduce_dtype, and FSDP2's controls:
// force-sum reductions, the divide factor, custom all-gather / reduce-scatter. Every value is
// judged against the plain model's gradient averaged over the ranks' batches.
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"

using dtensor::CommHook;
using dtensor::CommHookState;
using dtensor::FSDPModule;

namespace {

// test_fsdp_comm_hooks.py's Net: out(relu(net(x))),
// net = Sequential(Linear(8, 16), ReLU, Linear(16, 8)).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(0);
    net = register_module("net", torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                                                       torch::nn::Linear(16, 8)));
    out = register_module("out", torch::nn::Linear(8, 4));
    to(options().device());
  }
  at::Tensor forward(const at::Tensor& x) {
    return out->forward(torch::nn::functional::relu(net->forward(x)));
  }
  torch::nn::Sequential net{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Net);

enum class Mode { NoShard, Reshard, KeepUnsharded };
const Mode kModes[] = {Mode::NoShard, Mode::Reshard, Mode::KeepUnsharded};

std::string name(Mode m) {
  return m == Mode::NoShard ? "no_shard" : m == Mode::Reshard ? "reshard" : "keep_unsharded";
}

// A Net made data-parallel: replicate (no_shard), or fully_shard with, when `wrapping`, the
// seed's nested units (net.2 inside net) below the root. Units come out root last.
struct Parallel {
  Net model;
  std::optional<dtensor::ReplicateHandle> ddp;
  std::vector<FSDPModule> units;
  FSDPModule& root() { return units.back(); }
};

Parallel make(Mode mode, bool wrapping, const dtensor::DeviceMesh& mesh,
              std::optional<c10::ScalarType> reduce_dtype = std::nullopt) {
  Parallel p;
  if (mode == Mode::NoShard) {
    p.ddp =
        dtensor::replicate(*p.model, mesh, dtensor::ReplicateOptions().reduce_dtype(reduce_dtype));
    return p;
  }
  auto opts = FullyShardOptions().mesh(mesh).reshard_after_forward(mode == Mode::Reshard);
  opts.mp_policy(dtensor::MixedPrecisionPolicy().reduce_dtype(reduce_dtype));
  if (wrapping) {
    p.units.push_back(dtensor::fully_shard(*p.model->net[2], opts));
    p.units.push_back(dtensor::fully_shard(*p.model->net, opts));
  }
  p.units.push_back(dtensor::fully_shard(*p.model, opts));
  return p;
}

// This rank's batch (a different one on every rank).
at::Tensor batch() {
  at::manual_seed(100 + rank());
  return at::rand({16, 8}, options());
}

// The plain Net's gradients, averaged over every rank's batch: what data parallelism must give.
std::vector<at::Tensor> mean_grads() {
  Net plain;
  plain->forward(batch()).sum().backward();
  std::vector<at::Tensor> out;
  for (auto& p : plain->parameters()) {
    at::Tensor g = p.grad().clone();
    dtensor::all_reduce_(g, ReduceOp::Avg, dtensor::world_group());
    out.push_back(g);
  }
  return out;
}

std::vector<at::Tensor> grads(Net& model) {
  std::vector<at::Tensor> out;
  for (auto& p : model->parameters()) {
    out.push_back(full_value(p.grad()));
  }
  return out;
}

void require_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                   double rtol = 1e-5, double atol = 1e-5) {
  REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    INFO("parameter " << k);
    REQUIRE(a[k].scalar_type() == b[k].scalar_type());
    REQUIRE(close(a[k], b[k], rtol, atol));
  }
}

// The default hook plus `noise` added to the gradient first, counting its calls
// (test_fsdp_comm_hooks.py's DummyHook, with a real reduction so that the result can be
// checked).
CommHook noisy_hook(double noise, int& calls) {
  CommHook base = dtensor::default_comm_hook();
  CommHook hook;
  hook.name = "noisy";
  hook.reduce_scatter = [=, &calls](const CommHookState& s, at::Tensor& grad, at::Tensor& out) {
    ++calls;
    grad.add_(noise);
    base.reduce_scatter(s, grad, out);
  };
  hook.all_reduce = [=, &calls](const CommHookState& s, at::Tensor& bucket) {
    ++calls;
    bucket.add_(noise);
    base.all_reduce(s, bucket);
  };
  return hook;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

} // namespace

TEST_CASE(
    "register_comm_hook: on the root, for every unit below it (PyTorch's test_fsdp_comm_hooks.py)",
    "[comm_hooks][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  const auto mean = mean_grads();
  for (Mode mode : kModes) {
    for (bool wrapping : {true, false}) {
      if (mode == Mode::NoShard && !wrapping) {
        continue; // replicate has no nested units
      }
      INFO(name(mode) << " wrapping " << wrapping);
      Parallel p = make(mode, wrapping, mesh);
      int calls = 0;
      const double noise = 0.25;
      if (p.ddp) {
        REQUIRE_FALSE(p.ddp->has_comm_hook());
        p.ddp->register_comm_hook(CommHookState(), noisy_hook(noise, calls));
        REQUIRE(p.ddp->has_comm_hook());
        REQUIRE(has(error_of([&] { p.ddp->register_comm_hook({}, noisy_hook(noise, calls)); }),
                    "A communication hook is already registered"));
      } else {
        for (auto& u : p.units) {
          REQUIRE_FALSE(u.has_comm_hook());
        }
        if (wrapping) {
          REQUIRE(
              has(error_of([&] { p.units[0].register_comm_hook({}, noisy_hook(noise, calls)); }),
                  "register_comm_hook can only be called on a root instance"));
        }
        p.root().register_comm_hook(CommHookState(), noisy_hook(noise, calls));
        for (auto& u : p.units) {
          REQUIRE(u.has_comm_hook());
        }
        REQUIRE(has(error_of([&] { p.root().register_comm_hook({}, noisy_hook(noise, calls)); }),
                    "A communication hook is already registered"));
      }
      for (int it = 0; it < 2; ++it) {
        p.model->zero_grad();
        calls = 0;
        CommDebugMode m;
        p.model->forward(batch()).sum().backward();
        // One call per unit (per bucket for replicate), each one collective.
        const int64_t expected =
            p.ddp ? p.ddp->num_buckets() : static_cast<int64_t>(p.units.size());
        REQUIRE(calls == expected);
        REQUIRE(m.count(p.ddp ? CollectiveKind::AllReduce : CollectiveKind::ReduceScatter) ==
                expected);
        // Every rank added `noise` to its gradient before the mean: mean + noise.
        std::vector<at::Tensor> want;
        for (auto& g : mean) {
          want.push_back(g + noise);
        }
        require_close(grads(p.model), want);
      }
    }
  }
}

TEST_CASE("register_comm_hook: a unit below the root already has one; hooks of the wrong kind",
          "[comm_hooks][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  Net model;
  auto inner = dtensor::fully_shard(*model->net, FullyShardOptions().mesh(mesh));
  inner.register_comm_hook({}, dtensor::default_comm_hook()); // a root while nothing wraps it
  auto root = dtensor::fully_shard(*model, FullyShardOptions().mesh(mesh));
  REQUIRE(has(error_of([&] { root.register_comm_hook({}, dtensor::default_comm_hook()); }),
              "A communication hook is already registered"));
  REQUIRE_FALSE(root.has_comm_hook()); // nothing registered by the failed call
  CommHook only_all_reduce = dtensor::default_comm_hook();
  only_all_reduce.reduce_scatter = nullptr;
  REQUIRE(has(error_of([&] { root.register_comm_hook({}, only_all_reduce); }),
              "has no reduce_scatter"));
  Net other;
  auto ddp = dtensor::replicate(*other, mesh);
  CommHook only_reduce_scatter = dtensor::default_comm_hook();
  only_reduce_scatter.all_reduce = nullptr;
  REQUIRE(
      has(error_of([&] { ddp.register_comm_hook({}, only_reduce_scatter); }), "has no all_reduce"));
}

// FSDP1 (test_fsdp_comm_hooks.py) refuses hooks on hybrid strategies; dtensor runs the hook's
// reduce_scatter over the shard dim and its all_reduce over the replicate dim.
TEST_CASE("register_comm_hook on HSDP units: reduce_scatter over shard, all_reduce over "
          "replicate, the mean over every rank",
          "[comm_hooks][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {2, world() / 2}, {"rep", "shard"});
  const auto mean = mean_grads();
  for (bool bf16 : {false, true}) {
    INFO("bf16 compression " << bf16);
    Net model;
    dtensor::fully_shard(*model->net, FullyShardOptions().mesh(mesh));
    auto root = dtensor::fully_shard(*model, FullyShardOptions().mesh(mesh));
    root.register_comm_hook({},
                            bf16 ? dtensor::bf16_compress_hook() : dtensor::default_comm_hook());
    CommDebugMode mode;
    model->forward(batch()).sum().backward();
    REQUIRE(mode.count("shard", CollectiveKind::ReduceScatter) == 2);
    REQUIRE(mode.count("rep", CollectiveKind::AllReduce) == 2);
    REQUIRE(mode.count(CollectiveKind::AllReduce) == 2);
    for (const auto& rec : mode.records()) {
      if (rec.kind == CollectiveKind::ReduceScatter || rec.kind == CollectiveKind::AllReduce) {
        REQUIRE(rec.dtype == (bf16 ? c10::kBFloat16 : c10::kFloat));
      }
    }
    if (bf16) {
      require_close(grads(model), mean, 1e-2, 1e-2);
    } else {
      require_close(grads(model), mean);
    }
  }
  // A hook without all_reduce cannot serve the replicate dim.
  Net model;
  dtensor::fully_shard(*model->net, FullyShardOptions().mesh(mesh));
  auto root = dtensor::fully_shard(*model, FullyShardOptions().mesh(mesh["shard"]));
  CommHook only_reduce_scatter = dtensor::default_comm_hook();
  only_reduce_scatter.all_reduce = nullptr;
  const std::string e = error_of([&] { root.register_comm_hook({}, only_reduce_scatter); });
  REQUIRE(has(e, "has no all_reduce, which HSDP unit"));
  REQUIRE(has(e, "Sequential")); // names the HSDP unit (net)
  REQUIRE_FALSE(root.has_comm_hook());
}

TEST_CASE("fp16 / bf16 compression hooks equal mp_policy.reduce_dtype (PyTorch's "
          "test_fsdp_comm_hooks.py)",
          "[comm_hooks][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  const auto mean = mean_grads();
  for (c10::ScalarType low : {c10::kHalf, c10::kBFloat16}) {
    for (Mode mode : kModes) {
      for (bool wrapping : {true, false}) {
        INFO(c10::toString(low) << " " << name(mode) << " wrapping " << wrapping);
        Parallel with_hook = make(mode, wrapping, mesh);
        Parallel with_mp = make(mode, wrapping, mesh, low);
        const CommHook hook =
            low == c10::kHalf ? dtensor::fp16_compress_hook() : dtensor::bf16_compress_hook();
        if (with_hook.ddp) {
          with_hook.ddp->register_comm_hook({}, hook);
        } else {
          with_hook.root().register_comm_hook({}, hook);
        }
        torch::optim::SGD opt_hook(with_hook.model->parameters(), 0.1);
        torch::optim::SGD opt_mp(with_mp.model->parameters(), 0.1);
        for (int it = 0; it < 2; ++it) {
          opt_hook.zero_grad();
          opt_mp.zero_grad();
          {
            CommDebugMode m;
            with_hook.model->forward(batch()).sum().backward();
            REQUIRE(!m.records().empty());
            for (const auto& r : m.records()) {
              if (r.kind != CollectiveKind::AllGather) { // (the parameters' all-gathers)
                REQUIRE(r.dtype == low);                 // the reduction ran compressed
                REQUIRE(r.op == ReduceOp::Sum);
              }
            }
          }
          with_mp.model->forward(batch()).sum().backward();
          const auto a = grads(with_hook.model);
          const auto b = grads(with_mp.model);
          for (size_t k = 0; k < a.size(); ++k) {
            REQUIRE(a[k].scalar_type() == c10::kFloat); // cast back to the parameters' dtype
            REQUIRE(at::equal(a[k], b[k]));
          }
          if (it == 0) {
            require_close(a, mean, 2e-2, 2e-2); // low precision of the plain mean
          }
          opt_hook.step();
          opt_mp.step();
        }
        auto pa = with_hook.model->parameters();
        auto pb = with_mp.model->parameters();
        for (size_t k = 0; k < pa.size(); ++k) {
          REQUIRE(at::equal(full_value(pa[k]), full_value(pb[k])));
        }
      }
    }
  }
}

TEST_CASE("fully_shard: force-sum reductions and the divide factor (FSDP2)",
          "[comm_hooks][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  const auto mean = mean_grads();
  const ReduceOp avg = world() > 1 ? ReduceOp::Avg : ReduceOp::Sum; // size 1: SUM, no division
  struct Case {
    std::string name;
    std::function<void(FSDPModule&)> set;
    std::optional<c10::ScalarType> reduce_dtype;
    ReduceOp op;
    double scale; // of the mean
  };
  const std::vector<Case> cases = {
      {"default", [](FSDPModule&) {}, std::nullopt, avg, 1.0},
      {"force sum", [](FSDPModule& u) { u.set_force_sum_reduction_for_comms(true); }, std::nullopt,
       ReduceOp::Sum, 1.0},
      // A factor other than the data-parallel size: PreMulSum (1 / factor), then SUM.
      {"divide by 2W", [](FSDPModule& u) { u.set_gradient_divide_factor(2.0 * world()); },
       std::nullopt, ReduceOp::Sum, 0.5},
      {"bf16 reduce", [](FSDPModule&) {}, c10::kBFloat16, avg, 1.0},
      // fp16: SUM between a power-of-two pre-division and the post-division.
      {"fp16 reduce", [](FSDPModule&) {}, c10::kHalf, ReduceOp::Sum, 1.0},
      {"fp16 reduce, divide by 2W",
       [](FSDPModule& u) { u.set_gradient_divide_factor(2.0 * world()); }, c10::kHalf,
       ReduceOp::Sum, 0.5},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    Parallel p = make(Mode::Reshard, true, mesh, c.reduce_dtype);
    for (auto& u : p.units) {
      c.set(u);
    }
    CommDebugMode m;
    p.model->forward(batch()).sum().backward();
    REQUIRE(m.count(CollectiveKind::ReduceScatter) == over(world(), 3));
    for (const auto& r : m.records()) {
      if (r.kind == CollectiveKind::ReduceScatter) {
        REQUIRE(r.op == c.op);
        REQUIRE(r.dtype == c.reduce_dtype.value_or(c10::kFloat));
      }
    }
    std::vector<at::Tensor> want;
    for (auto& g : mean) {
      want.push_back(g * c.scale);
    }
    const double tol = c.reduce_dtype ? 2e-2 : 1e-5;
    require_close(grads(p.model), want, tol, tol);
  }
}

TEST_CASE("fully_shard: force-sum HSDP uses SUM for the reduce-scatter and the all-reduce",
          "[comm_hooks][world4]") {
  auto mesh = init_device_mesh(device_type(), {2, 2}, {"rep", "shard"});
  const auto mean = mean_grads();
  for (bool force : {false, true}) {
    INFO("force " << force);
    Net model;
    auto unit = dtensor::fully_shard(*model, FullyShardOptions().mesh(mesh));
    unit.set_force_sum_reduction_for_comms(force);
    CommDebugMode m;
    model->forward(batch()).sum().backward();
    REQUIRE(m.count("shard", CollectiveKind::AllGather) == 1); // forward (the root keeps it)
    REQUIRE(m.count("shard", CollectiveKind::ReduceScatter) == 1);
    REQUIRE(m.count("rep", CollectiveKind::AllReduce) == 1);
    REQUIRE(m.total_count() == 3);
    for (const auto& r : m.records()) {
      if (r.kind != CollectiveKind::AllGather) {
        REQUIRE(r.op == (force ? ReduceOp::Sum : ReduceOp::Avg));
      }
    }
    require_close(grads(model), mean);
  }
}

TEST_CASE("fully_shard: custom all-gather and reduce-scatter (FSDP2)",
          "[comm_hooks][world1][world2][world4]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  const auto mean = mean_grads();
  Parallel p = make(Mode::Reshard, true, mesh);
  int gathers = 0;
  int scatters = 0;
  int allocations = 0;
  auto allocate = [&](c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) {
    ++allocations;
    return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
  };
  dtensor::CustomAllGather ag;
  ag.allocate = allocate;
  ag.call = [&](at::Tensor& out, const at::Tensor& in, const dtensor::Group& g) {
    ++gathers;
    dtensor::all_gather_into_tensor(out, in, g);
  };
  // The custom reduce-scatter reduces, then triples its shard: the gradients show it ran.
  dtensor::CustomReduceScatter rs;
  rs.allocate = allocate;
  rs.call = [&](at::Tensor& out, const at::Tensor& in, const dtensor::Group& g, ReduceOp op) {
    ++scatters;
    dtensor::reduce_scatter_tensor_into(out, in, op, g);
    out.mul_(3.0);
  };
  for (auto& u : p.units) {
    u.set_custom_all_gather(ag);
    u.set_custom_reduce_scatter(rs);
  }
  CommDebugMode m;
  p.model->forward(batch()).sum().backward();
  // Over one rank neither is called, as in FSDP2 ([Note: one-rank shard groups alias]); the
  // reduce-scatter's input is still allocated by the custom allocator.
  const int64_t units = 3;
  REQUIRE(gathers == m.count(CollectiveKind::AllGather));
  REQUIRE(gathers >= over(world(), units)); // every unit in forward, resharded ones in backward
  REQUIRE(scatters == over(world(), units));
  REQUIRE(m.count(CollectiveKind::ReduceScatter) == over(world(), units));
  // Gather output; scatter input and output.
  REQUIRE(allocations == gathers + units + scatters);
  std::vector<at::Tensor> want;
  for (auto& g : mean) {
    want.push_back(world() > 1 ? g * 3.0 : g);
  }
  require_close(grads(p.model), want);
  // Empty calls restore the defaults.
  for (auto& u : p.units) {
    u.set_custom_all_gather({});
    u.set_custom_reduce_scatter({});
  }
  p.model->zero_grad();
  p.model->forward(batch()).sum().backward();
  REQUIRE(scatters == over(world(), units));
  require_close(grads(p.model), mean);
}
