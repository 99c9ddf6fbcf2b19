#pragma once

// Mixture of experts' judge for the tests (test_moe.cpp, test_moe_capacity.cpp): the layer's
// definition token by token on one process with autograd for the gradients, and one MoE layer
// run with its experts over an ep mesh of the whole world (ExpertParallel with given options),
// judged by it: outputs, every gradient, the bias update, the collectives counted.
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <dtensor/expert_parallel.h>

#include <models/moe/load_balance.h>
#include <models/moe/moe.h>

#include "support/prelude.h"

namespace moe_test {

using dtensor::ExpertParallel;
using dtensor::models::MoE;
using dtensor::models::MoEArgs;
using dtensor::models::MoEImpl;
using dtensor::models::MoEScore;

// What the routed experts see of a token's row (the row itself, or e.g. a float8 round trip).
using ExpertInput = std::function<at::Tensor(const at::Tensor&)>;

// Capacity dispatch with `factor` and `max_rows` (0: each call's own rows).
inline dtensor::ExpertParallelOptions capacity(double factor, int64_t max_rows = 0) {
  return dtensor::ExpertParallelOptions()
      .dispatch(dtensor::EpDispatch::Capacity)
      .capacity_factor(factor)
      .max_rows(max_rows);
}

// test_moe's routing extremes on the world's ranks (12 tokens each unless empty): even routing
// with a shared expert, every row to rank 0's experts, a rank without tokens, top-k = E. Hidden
// 64: the experts' elementwise kernels (silu) see whole vector blocks on every dispatch's rows
// (with a ragged tail the scalar and vectorized exp differ by an ulp), so dispatches that move
// the same rows give bit-equal values.
struct RoutingCase {
  const char* what;
  MoEArgs args;
  std::vector<int64_t> rows;
  std::function<void(MoEImpl&)> setup;
};
inline std::vector<RoutingCase> routing_extremes() {
  const MoEArgs args = MoEArgs().dim(16).hidden_dim(64).num_experts(8).top_k(2);
  const std::vector<int64_t> even(static_cast<size_t>(world()), 12);
  std::vector<int64_t> one_empty = even;
  one_empty[1] = 0;
  return {
      {"even routing, shared experts", MoEArgs(args).num_shared_experts(1), even, {}},
      {"every row to experts 0 and 1 (rank 0's)", args, even,
       [](MoEImpl& m) { m.expert_bias.narrow(0, 0, 2).fill_(100.0); }},
      {"rank 1 holds no tokens", args, one_empty, {}},
      {"top-k = E", MoEArgs(args).top_k(8).route_norm(true), even, {}},
  };
}

// Capacity dispatch's header rows: `local` int64 counts in rows of d fp32.
inline int64_t header_rows(int64_t local, int64_t d) {
  return (local * 8 + d * 4 - 1) / (d * 4);
}


// The layer's definition, token by token; returns [T, D].

inline at::Tensor reference_forward(const at::Tensor& x, MoEImpl& m, const at::Tensor& gate_w,
                                    const at::Tensor& w1, const at::Tensor& w2,
                                    const at::Tensor& w3, const ExpertInput& expert_input = {}) {
  const MoEArgs& a = m.args;
  const int64_t e_count = a.num_experts(), groups = a.num_expert_groups();
  const int64_t per = e_count / groups;
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < x.size(0); ++t) {
    at::Tensor xt = x[t];
    at::Tensor logits = at::mv(gate_w, xt);
    at::Tensor s = a.score_func() == MoEScore::Softmax ? logits.exp() / logits.exp().sum()
                                                       : 1.0 / (1.0 + (-logits).exp());
    std::vector<double> choice(static_cast<size_t>(e_count));
    for (int64_t e = 0; e < e_count; ++e) {
      choice[e] =
          s[e].item<double>() + (m.expert_bias.defined() ? m.expert_bias[e].item<double>() : 0.0);
    }
    // The groups whose two best choices sum highest.
    std::vector<bool> allowed(static_cast<size_t>(e_count), true);
    if (a.num_limited_groups() < groups) {
      std::vector<std::pair<double, int64_t>> gs;
      for (int64_t g = 0; g < groups; ++g) {
        std::vector<double> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(v.rbegin(), v.rend());
        gs.push_back({v[0] + (per > 1 ? v[1] : 0.0), g});
      }
      std::sort(gs.rbegin(), gs.rend());
      std::fill(allowed.begin(), allowed.end(), false);
      for (int64_t i = 0; i < a.num_limited_groups(); ++i) {
        for (int64_t e = 0; e < per; ++e) {
          allowed[gs[i].second * per + e] = true;
        }
      }
    }
    std::vector<std::pair<double, int64_t>> ranked;
    for (int64_t e = 0; e < e_count; ++e) {
      if (allowed[e]) {
        ranked.push_back({choice[e], e});
      }
    }
    std::sort(ranked.rbegin(), ranked.rend());
    at::Tensor gate_sum = at::zeros({});
    for (int64_t k = 0; k < a.top_k(); ++k) {
      gate_sum = gate_sum + s[ranked[k].second];
    }
    at::Tensor out = at::zeros_like(xt);
    for (int64_t k = 0; k < a.top_k(); ++k) {
      const int64_t e = ranked[k].second;
      at::Tensor g = s[e];
      if (a.route_norm()) {
        g = g / (gate_sum + 1e-20);
      }
      g = g * a.route_scale();
      const at::Tensor xe = expert_input ? expert_input(xt) : xt;
      at::Tensor h = at::silu(at::mv(w1[e], xe)) * at::mv(w3[e], xe);
      out = out + g * at::mv(w2[e], h);
    }
    rows.push_back(out);
  }
  at::Tensor out = rows.empty() ? at::zeros({0, x.size(1)}) : at::stack(rows);
  if (m.shared_experts) {
    auto& f = *m.shared_experts;
    out = out +
          at::matmul(at::silu(at::matmul(x, f.w1->weight.t())) * at::matmul(x, f.w3->weight.t()),
                     f.w2->weight.t());
  }
  return out;
}

// The reference's parameters: copies of the plain layer's, with gradients of their own.
struct Reference {
  at::Tensor gate, w1, w2, w3, x, out;
};

inline Reference run_reference(MoEImpl& m, const at::Tensor& x, const at::Tensor& g,
                               const ExpertInput& expert_input = {}) {
  auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(); };
  Reference r;
  r.gate = leaf(m.router->gate->weight);
  r.w1 = leaf(m.experts->w1);
  r.w2 = leaf(m.experts->w2);
  r.w3 = leaf(m.experts->w3);
  if (m.shared_experts) {
    // The shared experts' own weights take the gradient in place (the plain layer's).
    m.shared_experts->zero_grad();
  }
  r.x = leaf(x);
  r.out = reference_forward(r.x, m, r.gate, r.w1, r.w2, r.w3, expert_input);
  (r.out * g).sum().backward();
  return r;
}

inline MoE make_moe(const MoEArgs& a, int seed) {
  MoE m(a);
  at::manual_seed(seed);
  m->init_weights(0.02);
  return m;
}

inline bool near(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::allclose(a, b, /*rtol=*/1e-4, /*atol=*/1e-5);
}

inline MoEArgs small(int64_t experts = 8) {
  return MoEArgs().dim(16).hidden_dim(8).num_experts(experts).top_k(2);
}

inline DeviceMesh ep_mesh_of_world() {
  return init_device_mesh(device_type(), {world()}, {"ep"});
}

// Rows of this rank: `rows_of[r]` tokens for rank r, the global batch in rank order.
struct Split {
  int64_t start = 0, rows = 0, total = 0;
};
inline Split split_of(const std::vector<int64_t>& rows_of) {
  Split s;
  for (int r = 0; r < static_cast<int>(rows_of.size()); ++r) {
    if (r == rank()) {
      s.start = s.total;
      s.rows = rows_of[r];
    }
    s.total += rows_of[r];
  }
  return s;
}

// The layer with experts over ep (router hook too when `early`) against the reference on the
// whole batch; returns the forward's and backward's collective counts as text.
// "all_to_all 3": what a CommDebugMode counted, readable in a failure.
inline std::string counts_text(const std::map<CollectiveKind, int64_t>& counts) {
  std::string out;
  for (const auto& [kind, n] : counts) {
    out += (out.empty() ? "" : ", ") + dtensor::to_string(kind) + " " + std::to_string(n);
  }
  return out;
}

struct EpRun {
  std::string fwd, bwd;
  int64_t fwd_bytes = 0, bwd_bytes = 0;
  int64_t received = 0;            // rows this rank's experts computed
  std::vector<at::Tensor> results; // output, input gradient, local w1 / w2 / w3 gradients, gate's
};

inline at::Tensor summed(const at::Tensor& grad, const DeviceMesh& mesh) {
  return dtensor::all_reduce(grad, ReduceOp::Sum, mesh.get_group());
}

inline EpRun check_ep(const MoEArgs& a, const std::vector<int64_t>& rows_of, bool early,
                      const std::function<void(MoEImpl&)>& setup = {},
                      const dtensor::ExpertParallelOptions& options = {},
                      const ExpertInput& expert_input = {}) {
  DeviceMesh mesh = ep_mesh_of_world();
  MoE plain = make_moe(a, 9);
  MoE ep = make_moe(a, 9);
  if (setup) {
    setup(*plain);
    setup(*ep);
  }
  ExpertParallel style(options);
  style.apply(*ep->experts, mesh);
  std::optional<dtensor::ReplicateHandle> ddp;
  if (early) {
    style.apply_router(*ep->router, mesh);
    // The router's gradients must be a data-parallel wrapper's ([Note: the router's gradients
    // over ep]); this test sums them itself below, so the wrapper's all-reduce is off.
    ddp = dtensor::replicate(*ep->router, mesh);
    ddp->set_requires_gradient_sync(false);
  }
  const Split s = split_of(rows_of);
  at::manual_seed(4);
  at::Tensor x = at::randn({s.total, a.dim()});
  at::Tensor g = at::randn({s.total, a.dim()});
  at::Tensor xl = x.narrow(0, s.start, s.rows).clone().requires_grad_();
  EpRun run;
  dtensor::reset_ep_stats();
  at::Tensor out;
  {
    CommDebugMode mode;
    out = dtensor::call(ep, xl);
    run.fwd = counts_text(mode.comm_counts());
    run.fwd_bytes = mode.bytes_in(CollectiveKind::AllToAll);
  }
  {
    CommDebugMode mode;
    (out * g.narrow(0, s.start, s.rows)).sum().backward();
    run.bwd = counts_text(mode.comm_counts());
    run.bwd_bytes = mode.bytes_in(CollectiveKind::AllToAll);
  }
  run.received = dtensor::ep_stats().rows_received;
  const bool exchanged = early && options.dispatch() == dtensor::EpDispatch::Variable;
  CHECK(dtensor::ep_stats().early_exchanges == (exchanged ? 1 : 0));
  Reference r = run_reference(*plain, x, g, expert_input);
  CHECK(near(out, r.out.narrow(0, s.start, s.rows)));
  CHECK(near(xl.grad(), r.x.grad().narrow(0, s.start, s.rows)));
  // Expert weights: this rank's experts' gradient is its piece of the whole one.
  const int64_t local = a.num_experts() / world();
  using Pair = std::pair<at::Tensor, at::Tensor>;
  for (const auto& [w, ref] :
       {Pair{ep->experts->w1, r.w1}, Pair{ep->experts->w2, r.w2}, Pair{ep->experts->w3, r.w3}}) {
    REQUIRE(dtensor::is_dtensor(w.grad()));
    CHECK(DTensor(w.grad()).placements() == Placements{dtensor::Shard(0)});
    CHECK(near(DTensor(w.grad()).to_local(), ref.grad().narrow(0, rank() * local, local)));
  }
  run.results = {out.detach(), xl.grad()};
  for (const at::Tensor& w : {ep->experts->w1, ep->experts->w2, ep->experts->w3}) {
    run.results.push_back(DTensor(w.grad()).to_local());
  }
  run.results.push_back(ep->router->gate->weight.grad());
  // Replicated weights (the gate, shared experts): each rank's share, summed as data
  // parallelism would.
  CHECK(near(summed(ep->router->gate->weight.grad(), mesh), r.gate.grad()));
  if (ep->shared_experts) {
    auto ps = ep->shared_experts->parameters();
    auto qs = plain->shared_experts->parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      CHECK(near(summed(ps[i].grad(), mesh), qs[i].grad()));
    }
  }
  // The bias update over the ranks sees every rank's rows: the whole batch's counts.
  dtensor::models::ExpertBiasUpdate update(*ep);
  if (update.layers() == 1) {
    at::Tensor whole = at::bincount(
        std::get<1>(plain->router->forward(x, plain->expert_bias)).flatten(), {}, a.num_experts());
    CommDebugMode mode;
    update.start(mesh.get_group());
    update.finish();
    CHECK(counts_text(mode.comm_counts()) == "all_reduce 1");
    at::Tensor c = whole.to(at::kFloat);
    at::Tensor delta = *a.load_balance_coeff() * at::sign(c.mean() - c);
    CHECK(at::allclose(ep->expert_bias, plain->expert_bias + delta - delta.mean()));
  }
  return run;
}

inline std::string a2a(int64_t n) {
  return "all_to_all " + std::to_string(n);
}

} // namespace moe_test
