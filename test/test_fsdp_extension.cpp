// fully_shard's all-gather extension (include/dtensor/fsdp_extension.h), plugged in from here
// with public headers only, as a third party would: an int8 all-gather (each row of the padded
// shard as int8 with its own fp32 scale, absmax / 127).
//  - world2 / world4, FSDP over every rank and, on 4 ranks, HSDP (2 replicas x 2 shards): a
//    feed-forward unit whose two weights (50 x 32, uneven shards on 4 ranks) carry the
//    extension, under a root unit without it. Outputs, gradients and the weights after two SGD
//    steps equal the plain model on one process whose forward uses each weight rounded through
//    the same int8 rows (straight-through gradients); the all-gathers are as many as without
//    the extension and carry exactly the int8 bytes and scales instead of fp32 (16-byte
//    aligned pieces); each gather prepares once with both weights; metadata comes back.
//  - the same kept as gathered (keeps_gathered), as torchao's float8 weight is: w3's product
//    reads the kept int8 rows and scales itself (gathered_unsharded, its gradient to the
//    parameter), w1's Linear gets the value the extension makes from them; the same values and
//    bytes on the wire, no post_all_gather, and while the unit is unsharded it holds exactly
//    the int8 rows and scales (3,600 bytes where fp32 takes 12,800).
//  - world2: refusals, the same on every rank: an extension registered on a parameter
//    fully_shard manages, and an extension that rebuilds the wrong shape, each by name.
#include <dtensor/fsdp_extension.h>
#include <dtensor/fully_shard.h>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "support/prelude.h"

using dtensor::AllGatherExtension;
using dtensor::AllGatherInputs;
using dtensor::AllGatherParam;

namespace {

// Each row of `w` ([rows, in]) as int8 with its scale: q = round(w / s), s = absmax / 127.
std::pair<at::Tensor, at::Tensor> int8_rows(const at::Tensor& w) {
  const at::Tensor scale = (w.abs().amax({1}, true) / 127).clamp_min(1e-12).to(at::kFloat);
  return {at::round(w / scale).clamp(-127, 127).to(at::kChar), scale};
}

at::Tensor int8_round_trip(const at::Tensor& w) {
  const auto [q, scale] = int8_rows(w);
  return q.to(at::kFloat) * scale;
}

struct Int8Stats {
  bool keep = false; // the extensions keep what they gather
  int64_t prepares = 0;
  int64_t prepared_params = 0;
  int64_t pre = 0;
  int64_t post = 0;
  int64_t values = 0; // unsharded_value calls (kept)
  bool metadata_ok = true;
  int64_t after_backward = 0;
  int64_t unsharded_bytes = -1; // fsdp_memory_stats() in w3's kept product
};

class Int8AllGather final : public AllGatherExtension {
 public:
  explicit Int8AllGather(std::shared_ptr<Int8Stats> stats) : stats_(std::move(stats)) {}
  bool keeps_gathered() const override { return stats_->keep; }
  at::Tensor unsharded_value(const std::vector<at::Tensor>& kept,
                             const AllGatherParam& param) override {
    ++stats_->values;
    return (kept.at(0).to(at::kFloat) * kept.at(1)).to(param.param_dtype);
  }
  std::string name() const override { return "int8 rows"; }
  void
  prepare(const std::vector<std::pair<AllGatherExtension*, AllGatherParam>>& same_type) override {
    ++stats_->prepares;
    stats_->prepared_params += static_cast<int64_t>(same_type.size());
  }
  AllGatherInputs pre_all_gather(const AllGatherParam& param) override {
    ++stats_->pre;
    auto [q, scale] = int8_rows(param.padded.to(at::kFloat));
    return {{q, scale}, std::make_shared<std::string>(param.name)};
  }
  at::Tensor post_all_gather(const std::vector<at::Tensor>& gathered, const AllGatherInputs& sent,
                             const AllGatherParam& param) override {
    ++stats_->post;
    stats_->metadata_ok =
        stats_->metadata_ok && *std::static_pointer_cast<std::string>(sent.metadata) == param.name;
    return gathered.at(0).to(at::kFloat) * gathered.at(1);
  }
  void after_backward() override { ++stats_->after_backward; }

 private:
  std::shared_ptr<Int8Stats> stats_;
};

// A consumer of a weight kept as int8 rows and scales, as float8's linear is of its bits: x w^T
// from the kept tensors, the gradient to the parameter (straight through the rounding).
struct Int8LinearFn : torch::autograd::Function<Int8LinearFn> {
  static at::Tensor weight(const at::Tensor& param) {
    const std::vector<at::Tensor> kept = dtensor::gathered_unsharded(param);
    REQUIRE(kept.size() == 2);
    REQUIRE(kept[0].scalar_type() == at::kChar);
    return kept[0].to(at::kFloat) * kept[1];
  }
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& param, std::shared_ptr<Int8Stats> stats) {
    ctx->save_for_backward({x, param});
    stats->unsharded_bytes = dtensor::fsdp_memory_stats().unsharded_bytes;
    return at::linear(x, weight(param));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {grads[0].mm(weight(saved[1])), grads[0].t().mm(saved[0]), at::Tensor()};
  }
};

// A gated feed-forward unit (w1, w3: 32 -> 50) and an output Linear (50 -> 10). With `stats`
// keeping, w3's product is Int8LinearFn's.
struct GatedImpl : torch::nn::Module {
  GatedImpl()
      : w1(register_module("w1", torch::nn::Linear(torch::nn::LinearOptions(32, 50).bias(false)))),
        w3(register_module("w3", torch::nn::Linear(torch::nn::LinearOptions(32, 50).bias(false)))) {
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h3 =
        stats && stats->keep ? Int8LinearFn::apply(x, w3->weight, stats) : dtensor::call(w3, x);
    return at::relu(dtensor::call(w1, x)) * h3;
  }
  torch::nn::Linear w1, w3;
  std::shared_ptr<Int8Stats> stats;
};
TORCH_MODULE(Gated);

struct ModelImpl : torch::nn::Module {
  ModelImpl()
      : ffn(register_module("ffn", Gated())),
        output(register_module("output",
                               torch::nn::Linear(torch::nn::LinearOptions(50, 10).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) { return dtensor::call(output, dtensor::call(ffn, x)); }
  Gated ffn;
  torch::nn::Linear output;
};
TORCH_MODULE(Model);

Model seeded() {
  at::manual_seed(3);
  return Model();
}

// The model sharded over `mesh`, its ffn weights with the extension when `stats` is set.
Model sharded(const DeviceMesh& mesh, const std::shared_ptr<Int8Stats>& stats) {
  Model m = seeded();
  if (stats) {
    m->ffn->stats = stats;
    dtensor::set_all_gather_extension(m->ffn->w1->weight, std::make_shared<Int8AllGather>(stats));
    dtensor::set_all_gather_extension(m->ffn->w3->weight, std::make_shared<Int8AllGather>(stats));
  }
  dtensor::fully_shard(*m->ffn, FullyShardOptions().mesh(mesh));
  dtensor::fully_shard(*m, FullyShardOptions().mesh(mesh));
  return m;
}

// The plain model's forward with the ffn weights rounded through int8 rows, gradients
// straight through to the fp32 weights.
at::Tensor plain_forward(Model& m, const at::Tensor& x) {
  auto rounded = [](const at::Tensor& w) { return w + (int8_round_trip(w.detach()) - w).detach(); };
  const at::Tensor h = at::relu(at::linear(x, rounded(m->ffn->w1->weight))) *
                       at::linear(x, rounded(m->ffn->w3->weight));
  return at::linear(h, m->output->weight);
}

struct Step {
  at::Tensor y;
  int64_t all_gathers = 0;
  int64_t all_gather_bytes = 0;
};

Step step(Model& m, const at::Tensor& x, const at::Tensor& g) {
  Step out;
  CommDebugMode mode;
  out.y = dtensor::call(m, x);
  (out.y * g).sum().backward();
  out.all_gathers = mode.count(CollectiveKind::AllGather);
  out.all_gather_bytes = mode.bytes_in(CollectiveKind::AllGather);
  return out;
}

int64_t aligned16(int64_t bytes) {
  return (bytes + 15) / 16 * 16;
}

void check_against_plain(const DeviceMesh& mesh, int64_t shard_size, bool keep) {
  auto stats = std::make_shared<Int8Stats>();
  stats->keep = keep;
  Model ext = sharded(mesh, stats);
  Model fp32 = sharded(mesh, nullptr);
  Model plain = seeded();
  torch::optim::SGD opt_ext(ext->parameters(), 0.5);
  torch::optim::SGD opt_plain(plain->parameters(), 0.5);
  const int64_t chunk = (50 + shard_size - 1) / shard_size;
  // One ffn gather: per weight int8 rows and fp32 scales where fp32 sends 4 bytes a value.
  const int64_t ext_stride = 2 * (aligned16(chunk * 32) + aligned16(chunk * 4));
  const int64_t fp32_stride = 2 * chunk * 32 * 4;
  for (int s = 0; s < 2; ++s) {
    INFO("step " << s);
    at::manual_seed(100 + s);
    const at::Tensor x = at::randn({4 * world(), 32});
    const at::Tensor g = at::randn({4 * world(), 10});
    const at::Tensor x_r = x.narrow(0, 4 * rank(), 4);
    const at::Tensor g_r = g.narrow(0, 4 * rank(), 4);
    const int64_t pre_before = stats->pre;
    const Step a = step(ext, x_r, g_r);
    const Step b = step(fp32, x_r, g_r);
    const int64_t ffn_gathers = stats->pre - pre_before;
    CHECK(ffn_gathers == 4); // two weights, gathered in forward and again in backward
    (plain_forward(plain, x) * g).sum().div(static_cast<double>(world())).backward();
    CHECK(close(a.y.detach(), plain_forward(plain, x_r).detach()));
    CHECK(close(full_value(ext->ffn->w1->weight.grad()), plain->ffn->w1->weight.grad()));
    CHECK(close(full_value(ext->ffn->w3->weight.grad()), plain->ffn->w3->weight.grad()));
    CHECK(close(full_value(ext->output->weight.grad()), plain->output->weight.grad()));
    CHECK(a.all_gathers == b.all_gathers);
    const int64_t gathers_of_ffn = ffn_gathers / 2;
    CHECK(b.all_gather_bytes - a.all_gather_bytes ==
          (shard_size > 1 ? gathers_of_ffn * (fp32_stride - ext_stride) : 0));
    opt_ext.step();
    opt_plain.step();
    opt_ext.zero_grad();
    opt_plain.zero_grad();
    fp32->zero_grad();
  }
  CHECK(close(full_value(ext->ffn->w1->weight), plain->ffn->w1->weight));
  CHECK(stats->post == (keep ? 0 : stats->pre));
  CHECK((stats->values > 0) == keep); // w1's Linear reads the value made from the kept tensors
  if (keep) {
    // The root's fp32 output weight (10 x 50) and the ffn's kept int8 rows and fp32 scales.
    CHECK(stats->unsharded_bytes == 10 * 50 * 4 + 2 * (50 * 32 + 50 * 4));
  }
  CHECK(stats->prepared_params == 2 * stats->prepares);
  CHECK(stats->prepares * 2 == stats->pre);
  CHECK(stats->metadata_ok);
  CHECK(stats->after_backward == 2 * 2); // both weights, each backward
}

} // namespace

TEST_CASE("fsdp extension: an int8 all-gather from outside equals the plain model with int8 "
          "weights and sends int8 bytes",
          "[world2][world4]") {
  for (const bool keep : {false, true}) {
    INFO("kept as gathered: " << keep);
    DYNAMIC_SECTION("FSDP" << (keep ? ", kept" : "")) {
      check_against_plain(init_device_mesh(device_type(), {world()}, {"dp"}), world(), keep);
    }
    if (world() >= 4) {
      DYNAMIC_SECTION("HSDP" << (keep ? ", kept" : "")) {
        check_against_plain(
            init_device_mesh(device_type(), {2, world() / 2}, {"replicate", "shard"}), world() / 2,
            keep);
      }
    }
  }
}

namespace {

class WrongShape final : public AllGatherExtension {
 public:
  std::string name() const override { return "wrong shape"; }
  AllGatherInputs pre_all_gather(const AllGatherParam& param) override {
    return {{param.padded}, nullptr};
  }
  at::Tensor post_all_gather(const std::vector<at::Tensor>& gathered, const AllGatherInputs&,
                             const AllGatherParam&) override {
    return gathered.at(0).flatten();
  }
};

} // namespace

TEST_CASE("fsdp extension: refusals name the parameter and the extension", "[world2]") {
  auto mesh = init_device_mesh(device_type(), {world()}, {"dp"});
  {
    Model m = seeded();
    dtensor::fully_shard(*m->ffn, FullyShardOptions().mesh(mesh));
    CHECK_THROWS_WITH(
        dtensor::set_all_gather_extension(m->ffn->w1->weight, std::make_shared<WrongShape>()),
        contains("the parameter is fully_shard's already"));
  }
  Model m = seeded();
  dtensor::set_all_gather_extension(m->ffn->w1->weight, std::make_shared<WrongShape>());
  CHECK(dtensor::all_gather_extension(m->ffn->w1->weight)->name() == "wrong shape");
  dtensor::fully_shard(*m->ffn, FullyShardOptions().mesh(mesh));
  dtensor::fully_shard(*m, FullyShardOptions().mesh(mesh));
  CHECK(dtensor::all_gather_extension(m->ffn->w1->weight)->name() == "wrong shape");
  CHECK(dtensor::all_gather_extension(m->ffn->w3->weight) == nullptr);
  CHECK_THROWS_WITH(dtensor::call(m, at::randn({2, 32})),
                    contains("all-gather extension 'wrong shape' of 'w1.weight' must rebuild "
                             "every rank's padded shard as a floating tensor of shape [2, 25, "
                             "32], got [1600]"));
}
