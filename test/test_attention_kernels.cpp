// The CUDA attention kernels (flash, memory-efficient, cuDNN; forward and backward) on
// DTensors, on CPU: each kernel gets a CPU analogue here (plain attention with the kernel's
// signature and output shapes), and the DTensor call is judged against the plain call
// (values), against PyTorch's meta kernels (the global shape of every output, from
// attention/meta_shapes.py at build time) and by its exact collective counts.
// [Note: attention layouts] in lib/tensor/ops/attention.cpp.
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/library.h>

#include "support/prelude.h"

namespace {

using Stack = torch::jit::Stack;

// softmax(q k^T * scale + bias) v, with its logsumexp; on `grad` the gradients of q, k, v
// and the bias.
struct Attention {
  at::Tensor out, lse;
  std::vector<at::Tensor> grads; // q, k, v, bias (undefined without one)
};

Attention attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& bias, const at::Tensor& grad) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (bias.defined()) {
    scores = scores + bias;
  }
  const at::Tensor p = at::softmax(scores, -1);
  Attention a;
  a.lse = at::logsumexp(scores, -1);
  a.out = at::matmul(p, v);
  if (grad.defined()) { // by hand: the kernels run below autograd
    const at::Tensor dp = at::matmul(grad, v.transpose(-2, -1));
    const at::Tensor ds = p * (dp - (dp * p).sum(-1, true));
    a.grads = {at::matmul(ds, k) * scale, at::matmul(ds.transpose(-2, -1), q) * scale,
               at::matmul(p.transpose(-2, -1), grad), bias.defined() ? ds : at::Tensor()};
  }
  return a;
}

at::Tensor arg(const Stack& s, size_t n, size_t i) {
  const c10::IValue& v = s[s.size() - n + i];
  return v.isTensor() ? v.toTensor() : at::Tensor();
}

void finish(Stack* s, size_t nargs, std::vector<c10::IValue> results) {
  torch::jit::drop(*s, nargs);
  for (auto& r : results) {
    s->push_back(std::move(r));
  }
}

at::Tensor scalar_state(c10::ScalarType t, std::vector<int64_t> shape = {}) {
  return at::empty(shape, at::TensorOptions().dtype(t)); // random state: never read here
}

// Output shapes as PyTorch's meta kernels give them (the test checks them against those).
void efficient(const c10::OperatorHandle&, Stack* s) {
  const at::Tensor q = arg(*s, 8, 0);
  Attention a = attention(q, arg(*s, 8, 1), arg(*s, 8, 2), arg(*s, 8, 3), {});
  const bool lse = (*s)[s->size() - 8 + 4].toBool();
  const int64_t padded = lse ? (q.size(2) + 31) / 32 * 32 : 0;
  at::Tensor l = at::zeros({q.size(0), q.size(1), padded}, q.options());
  if (lse) {
    l.narrow(2, 0, q.size(2)).copy_(a.lse);
  }
  finish(s, 8, {a.out, l, scalar_state(at::kLong), scalar_state(at::kLong)});
}

void efficient_backward(const c10::OperatorHandle&, Stack* s) {
  Attention a =
      attention(arg(*s, 13, 1), arg(*s, 13, 2), arg(*s, 13, 3), arg(*s, 13, 4), arg(*s, 13, 0));
  finish(s, 13, {a.grads[0], a.grads[1], a.grads[2], a.grads[3]});
}

void flash(const c10::OperatorHandle&, Stack* s) {
  const at::Tensor q = arg(*s, 7, 0), k = arg(*s, 7, 1);
  Attention a = attention(q, k, arg(*s, 7, 2), {}, {});
  const bool debug = (*s)[s->size() - 7 + 5].toBool();
  at::Tensor mask =
      debug
          ? at::zeros({q.size(0), q.size(1), q.size(2), (k.size(2) + 127) / 128 * 128}, q.options())
          : at::zeros({0}, q.options());
  finish(s, 7,
         {a.out, a.lse, at::Tensor(), at::Tensor(), c10::SymInt(q.size(2)), c10::SymInt(k.size(2)),
          scalar_state(at::kUInt64, {2}), scalar_state(at::kUInt64), mask});
}

void flash_backward(const c10::OperatorHandle&, Stack* s) {
  Attention a = attention(arg(*s, 15, 1), arg(*s, 15, 2), arg(*s, 15, 3), {}, arg(*s, 15, 0));
  finish(s, 15, {a.grads[0], a.grads[1], a.grads[2]});
}

void cudnn(const c10::OperatorHandle&, Stack* s) {
  const at::Tensor q = arg(*s, 9, 0), k = arg(*s, 9, 1);
  Attention a = attention(q, k, arg(*s, 9, 2), arg(*s, 9, 3), {});
  finish(s, 9,
         {a.out, a.lse.unsqueeze(-1), at::Tensor(), at::Tensor(), c10::SymInt(q.size(2)),
          c10::SymInt(k.size(2)), scalar_state(at::kLong), scalar_state(at::kLong), at::Tensor()});
}

void cudnn_backward(const c10::OperatorHandle&, Stack* s) {
  Attention a =
      attention(arg(*s, 16, 1), arg(*s, 16, 2), arg(*s, 16, 3), arg(*s, 16, 8), arg(*s, 16, 0));
  finish(s, 16, {a.grads[0], a.grads[1], a.grads[2]});
}

} // namespace

// The CPU analogues: the kernels have CUDA implementations only.
TORCH_LIBRARY_IMPL(aten, CPU, m) {
  m.impl("_scaled_dot_product_efficient_attention",
         torch::CppFunction::makeFromBoxedFunction<&efficient>());
  m.impl("_scaled_dot_product_efficient_attention_backward",
         torch::CppFunction::makeFromBoxedFunction<&efficient_backward>());
  m.impl("_scaled_dot_product_flash_attention",
         torch::CppFunction::makeFromBoxedFunction<&flash>());
  m.impl("_scaled_dot_product_flash_attention_backward",
         torch::CppFunction::makeFromBoxedFunction<&flash_backward>());
  m.impl("_scaled_dot_product_cudnn_attention",
         torch::CppFunction::makeFromBoxedFunction<&cudnn>());
  m.impl("_scaled_dot_product_cudnn_attention_backward",
         torch::CppFunction::makeFromBoxedFunction<&cudnn_backward>());
}

namespace {

struct Case {
  std::string op;
  int64_t b, h, l, s, e, ev;
  bool bias, flag;
  std::vector<std::optional<std::vector<int64_t>>> forward, backward;
};

std::vector<std::optional<std::vector<int64_t>>> read_shapes(const nlohmann::json& j) {
  std::vector<std::optional<std::vector<int64_t>>> out;
  for (const auto& s : j) {
    out.push_back(s.is_null() ? std::nullopt
                              : std::optional<std::vector<int64_t>>(s.get<std::vector<int64_t>>()));
  }
  return out;
}

std::vector<Case> meta_cases() {
  // Beside this program in the build (a path built in would name the clone and cost every
  // clean clone its ccache hit).
  std::ifstream f(std::filesystem::read_symlink("/proc/self/exe").parent_path() /
                  "attention_meta_shapes.json");
  REQUIRE(f.good());
  const nlohmann::json j = nlohmann::json::parse(f);
  std::vector<Case> out;
  // The real kernels on a GPU take aligned shapes only (attention/meta_shapes.py).
  for (const auto& c : j.at(device_type() == c10::kCUDA ? "gpu_cases" : "cases")) {
    const auto d = c.at("dims").get<std::vector<int64_t>>();
    out.push_back({c.at("op"), d[0], d[1], d[2], d[3], d[4], d[5], c.at("bias"), c.at("flag"),
                   read_shapes(c.at("forward")), read_shapes(c.at("backward"))});
  }
  REQUIRE(out.size() == 10);
  return out;
}

const c10::OperatorHandle& op_named(const std::string& name) {
  static std::map<std::string, c10::OperatorHandle> ops;
  auto it = ops.find(name);
  if (it == ops.end()) {
    it = ops.emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "")).first;
  }
  return it->second;
}

std::string kernel(const Case& c, bool backward) {
  return "aten::_scaled_dot_product_" + c.op + "_attention" + (backward ? "_backward" : "");
}

// The forward arguments of `c` over q, k, v (and bias): plain or DTensors alike.
Stack forward_args(const Case& c, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& bias) {
  const std::optional<double> scale;
  if (c.op == "flash") {
    return {q, k, v, 0.0, false, c.flag, scale};
  }
  if (c.op == "efficient") {
    return {q, k, v, c.bias ? c10::IValue(bias) : c10::IValue(), c.flag, 0.0, false, scale};
  }
  return {q, k, v, c.bias ? c10::IValue(bias) : c10::IValue(), c.flag, 0.0, false, false, scale};
}

// The backward arguments: the gradient, q, k, v, the bias, and the forward's results `f`.
Stack backward_args(const Case& c, const at::Tensor& g, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& bias, const Stack& f) {
  const std::optional<double> scale;
  if (c.op == "flash") {
    return {g, q, k, v, f[0], f[1], f[2], f[3], f[4], f[5], 0.0, false, f[6], f[7], scale};
  }
  // attn_bias is a Tensor, not an optional one, in both backwards: without a bias autograd
  // passes an undefined tensor (the GPU kernels refuse None; seen on a GPU).
  const c10::IValue no_bias = c.bias ? c10::IValue(bias) : c10::IValue(at::Tensor());
  if (c.op == "efficient") {
    return {g,    q,    k,    v,   no_bias, f[0], f[1], f[2], f[3], 0.0,
            std::vector<bool>{true, true, true, c.bias}, false, scale};
  }
  // (out, logsumexp, philox seed and offset, bias, cum_seq_q / k, max_q / k, ...)
  return {g,       q,    k,    v,    f[0], f[1], f[6],  f[7],
          no_bias, f[2], f[3], f[4], f[5], 0.0,  false, scale};
}

at::Tensor seeded(std::vector<int64_t> shape, int seed, at::ScalarType dtype = at::kFloat) {
  at::manual_seed(seed);
  return at::randn(shape, options()).to(dtype);
}

// The real kernels on a GPU: flash and cuDNN take half precision only (their CPU analogues
// here take anything; the memory-efficient kernel takes float32 too).
at::ScalarType dtype_of(const Case& c) {
  return device_type() == c10::kCUDA && (c.op == "flash" || c.op == "cudnn") ? at::kBFloat16
                                                                              : at::kFloat;
}

// `t` on `mesh` as `p` where it has dims to shard, else Replicate (0-dim random state).
at::Tensor placed(const at::Tensor& t, const DeviceMesh& mesh, const Placements& p) {
  if (!t.defined()) {
    return t;
  }
  for (const auto& x : p) {
    if (!t.is_floating_point() || (x.is_shard() && x.dim() >= t.dim())) {
      // The same on every rank already (Gloo cannot broadcast UInt64 random state).
      return DTensor::from_local(t, mesh, Placements(p.size(), Placement::replicate()));
    }
  }
  return dtensor::distribute_tensor(t, mesh, p);
}

// Per output: the plain result's value and the meta kernel's shape against the DTensor's.
void check_outputs(const Stack& got, const Stack& want,
                   const std::vector<std::optional<std::vector<int64_t>>>& meta,
                   const Placements& follow, const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (size_t r = 0; r < got.size(); ++r) {
    INFO(what << " output " << r);
    if (!want[r].isTensor() || !want[r].toTensor().defined()) {
      REQUIRE((!got[r].isTensor() || !got[r].toTensor().defined()));
      continue;
    }
    DTensor d(got[r].toTensor());
    if (meta[r]) {
      REQUIRE(d.sizes().vec() == *meta[r]);
    }
    REQUIRE(d.sizes().vec() == want[r].toTensor().sizes().vec());
    if (d.dim() >= 2 && want[r].toTensor().numel() > 0) {
      REQUIRE(close(d.full_tensor().to(at::kFloat), want[r].toTensor().to(at::kFloat), 1e-4, 1e-4));
    }
    // [batch, heads, ...] outputs keep the inputs' batch or head shards.
    if (d.dim() >= 3 && d.sizes()[0] == want[0].toTensor().size(0)) {
      for (size_t i = 0; i < follow.size(); ++i) {
        if (follow[i].is_shard(0) || follow[i].is_shard(1)) {
          REQUIRE((d.placements()[i] == follow[i] || d.placements()[i].is_partial()));
        }
      }
    }
  }
}

// The layouts each case runs on, with the collectives its forward costs.
struct Layout {
  DeviceMesh mesh;
  Placements p;
};

std::vector<Layout> layouts() {
  const int w = world();
  auto mesh = init_device_mesh(device_type(), {w}, {"x"});
  std::vector<Layout> out{{mesh, {Placement::replicate()}}};
  for (int64_t d : {0, 1, 2}) {
    out.push_back({mesh, {Placement::shard(d)}});
  }
  if (w == 4) {
    auto m2 = init_device_mesh(device_type(), {2, 2}, {"a", "b"});
    out.push_back({m2, {Placement::shard(0), Placement::shard(1)}});
    out.push_back({m2, {Placement::shard(2), Placement::shard(1)}});
  }
  return out;
}

} // namespace

TEST_CASE("CUDA attention kernels: batch and head shards stay local; shapes as PyTorch's meta "
          "kernels; values as the plain kernel",
          "[attention][world1][world2][world4]") {
  for (const Case& c : meta_cases()) {
    const at::ScalarType dt = dtype_of(c);
    const at::Tensor q = seeded({c.b, c.h, c.l, c.e}, 1, dt), k = seeded({c.b, c.h, c.s, c.e}, 2, dt),
                     v = seeded({c.b, c.h, c.s, c.ev}, 3, dt),
                     bias = seeded({c.b, c.h, c.l, c.s}, 4, dt);
    if (device_type() == c10::kCUDA && c.op == "flash" && c.flag) {
      // The GPU kernel returns its debug mask only with dropout and refuses otherwise (its
      // CPU analogue here does not): the DTensor call passes the refusal on, on every layout.
      const std::string refusal = "return_softmax is only supported when p_dropout > 0.0";
      Stack plain = forward_args(c, q, k, v, bias);
      REQUIRE_THROWS_WITH(op_named(kernel(c, false)).callBoxed(plain), contains(refusal));
      for (const Layout& l : layouts()) {
        Stack got = forward_args(c, placed(q, l.mesh, l.p), placed(k, l.mesh, l.p),
                                 placed(v, l.mesh, l.p), placed(bias, l.mesh, l.p));
        REQUIRE_THROWS_WITH(op_named(kernel(c, false)).callBoxed(got), contains(refusal));
      }
      continue;
    }
    // Autograd asks the memory-efficient and cuDNN kernels for the log-sum-exp whenever a
    // backward follows, and their GPU backwards need it ("LSE is not correctly aligned" on
    // an H200): on a GPU those cases without it are judged in forward only.
    const bool with_backward = device_type() != c10::kCUDA || c.op == "flash" || c.flag;
    Stack want = forward_args(c, q, k, v, bias);
    op_named(kernel(c, false)).callBoxed(want);
    const at::Tensor g = seeded(want[0].toTensor().sizes().vec(), 5, dt);
    Stack want_back = backward_args(c, g, q, k, v, bias, want);
    if (with_backward) {
      op_named(kernel(c, true)).callBoxed(want_back);
    }
    for (const Layout& l : layouts()) {
      const std::string what = kernel(c, false) + " bias " + std::to_string(c.bias) + " flag " +
                               std::to_string(c.flag) + " on " + dtensor::to_string(l.p);
      INFO(what);
      Stack got = forward_args(c, placed(q, l.mesh, l.p), placed(k, l.mesh, l.p),
                               placed(v, l.mesh, l.p), placed(bias, l.mesh, l.p));
      int64_t gathered = 0; // mesh dims on which q, k, v (and the bias) are gathered
      for (const auto& x : l.p) {
        gathered += x.is_shard(2) && l.mesh.size() > 1 ? 1 : 0;
      }
      {
        CommDebugMode mode;
        op_named(kernel(c, false)).callBoxed(got);
        // Batch and head shards: no collective. A sequence shard: each of q, k, v (and the
        // bias) gathered once on each such mesh dim.
        const int64_t tensors = c.bias && c.op != "flash" ? 4 : 3;
        REQUIRE(mode.count(CollectiveKind::AllGather) == gathered * tensors);
        REQUIRE(mode.total_count() == gathered * tensors);
      }
      check_outputs(got, want, c.forward, l.p, what);
      if (!with_backward) {
        continue;
      }
      Stack f;
      for (const auto& r : want) { // the forward's results laid out as q
        f.push_back(r.isTensor() ? c10::IValue(placed(r.toTensor(), l.mesh, l.p)) : r);
      }
      Stack back =
          backward_args(c, placed(g, l.mesh, l.p), placed(q, l.mesh, l.p), placed(k, l.mesh, l.p),
                        placed(v, l.mesh, l.p), placed(bias, l.mesh, l.p), f);
      op_named(kernel(c, true)).callBoxed(back);
      check_outputs(back, want_back, c.backward, l.p, what + " backward");
    }
  }
}
