// Muon on every layout, judged by PyTorch: three steps of dtensor::optim::Muon (the matrices)
// with AdamW (a vector and an embedding-like matrix) in one optimizer object leave the
// parameters equal, bit for bit, to torch.optim.Muon + torch.optim.AdamW on one process with
// the same gradients (test/optim/muon_judge.py, run at build time), for plain tensors, FSDP,
// HSDP, FSDP x TP, EP x efsdp and pipeline stages, in two configurations (defaults; no
// Nesterov, 3 steps, match_rms_adamw, AMSGrad). Guards the owner exchange: exact all-to-alls
// per step and shard group, exact bytes, owners balanced; bad options refused.
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <map>

#include <dtensor/checkpoint.h>
#include <dtensor/muon.h>
#include <dtensor/optim_state_dict.h>

#include "support/prelude.h"

using dtensor::Replicate;
using dtensor::Shard;
using dtensor::optim::Muon;
using dtensor::optim::MuonOptions;
using torch::optim::AdamWOptions;
using torch::optim::OptimizerParamGroup;

namespace {

const std::vector<std::string> kMatrices = {"wide",     "tall", "square_a",
                                            "square_b", "odd",  "experts"};
const std::vector<std::string> kAdamW = {"norm", "embed"};
constexpr int kSteps = 3;

// The judge's tensors: "init.<name>", "grad.<step>.<name>", "<config>.<name>".
const dtensor::StateDict& judge() {
  static const dtensor::StateDict tensors = [] {
    namespace fs = std::filesystem;
    // Beside this program in the build, as attention_meta_shapes.json.
    const fs::path file =
        fs::read_symlink("/proc/self/exe").parent_path() / "muon_judge.safetensors";
    // A fresh directory of its own (mkdtemp), holding only a link to the judge's file.
    std::string tmpl = (fs::temp_directory_path() / "dtensor-muon-judge-XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    const fs::path dir = tmpl;
    fs::create_symlink(file, dir / "model.safetensors");
    dtensor::StateDict out;
    for (const auto& info : dtensor::checkpoint::read_metadata(dir.string())) {
      out.insert(info.key, at::empty(info.shape, at::kFloat));
    }
    dtensor::checkpoint::load(out, dir.string());
    fs::remove(dir / "model.safetensors"); // the link, not the judge's file
    fs::remove(dir);
    return out;
  }();
  return tensors;
}

at::Tensor judged(const std::string& key) {
  return judge()[key].to(options().device());
}

std::vector<OptimizerParamGroup> groups(const std::string& config,
                                        const std::map<std::string, at::Tensor>& params) {
  std::vector<at::Tensor> matrices;
  std::vector<at::Tensor> others;
  for (const auto& [name, p] : params) {
    const bool adamw = std::find(kAdamW.begin(), kAdamW.end(), name) != kAdamW.end();
    (adamw ? others : matrices).push_back(p);
  }
  MuonOptions muon(0.02);
  AdamWOptions adamw(3e-3);
  adamw.betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
  if (config == "variant") {
    muon = MuonOptions(0.01).weight_decay(0.05).momentum(0.9).nesterov(false).ns_steps(3);
    muon.adjust_lr_fn("match_rms_adamw");
    adamw = AdamWOptions(1e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.0).amsgrad(true);
  }
  std::vector<OptimizerParamGroup> out;
  out.emplace_back(matrices, std::make_unique<MuonOptions>(muon));
  out.emplace_back(others, std::make_unique<AdamWOptions>(adamw));
  return out;
}

// A layout: the mesh (undefined: plain tensors) and each parameter's placements.
struct Layout {
  DeviceMesh mesh;
  std::function<Placements(const std::string&)> placements;
  // The gradients' placements when they differ from the parameters' (redistributed by Muon).
  std::function<Placements(const std::string&)> grad_placements = nullptr;
  std::vector<std::string> names = {"wide", "tall",    "square_a", "square_b",
                                    "odd",  "experts", "norm",     "embed"};
};

at::Tensor laid_out(const at::Tensor& full, const Layout& l, const std::string& name) {
  return l.mesh.defined() ? at::Tensor(dtensor::distribute_tensor(full, l.mesh, l.placements(name),
                                                                  std::nullopt))
                          : full.clone();
}

struct Run {
  std::vector<int64_t> all_to_alls;                    // per step
  std::vector<dtensor::optim::MuonExchange> exchanges; // the last step's
  int64_t bytes_in = 0; // the last step's, as CommDebugMode counts them
};

// Three steps on `layout`; every parameter then equals PyTorch's, bit for bit.
Run run(const Layout& layout, const std::string& config) {
  std::map<std::string, at::Tensor> params;
  for (const auto& name : layout.names) {
    params[name] = laid_out(judged("init." + name), layout, name).set_requires_grad(true);
  }
  Muon opt(groups(config, params));
  Run out;
  for (int k = 0; k < kSteps; ++k) {
    for (auto& [name, p] : params) {
      Layout g = layout;
      g.placements = layout.grad_placements ? layout.grad_placements : layout.placements;
      p.mutable_grad() = laid_out(judged("grad." + std::to_string(k) + "." + name), g, name);
    }
    CommDebugMode mode;
    opt.step();
    out.all_to_alls.push_back(mode.count(CollectiveKind::AllToAll));
    REQUIRE(mode.total_count() == out.all_to_alls.back());
    out.bytes_in = mode.total_bytes_in();
  }
  out.exchanges = opt.last_exchanges();
  for (const auto& [name, p] : params) {
    INFO(config << " " << name << " on rank " << rank());
    const at::Tensor full = dtensor::is_dtensor(p) ? DTensor(p).full_tensor() : p.detach();
    REQUIRE(same(full, judged(config + "." + name)));
  }
  return out;
}

int64_t sum_over_ranks(int64_t v) {
  at::Tensor t = at::full({1}, static_cast<double>(v), options(at::kDouble));
  dtensor::all_reduce_(t, ReduceOp::Sum, dtensor::world_group());
  return static_cast<int64_t>(t.item<double>());
}

// The parameters under their names, for the state dict functions.
struct Named : torch::nn::Module {
  explicit Named(const std::map<std::string, at::Tensor>& params) {
    for (const auto& [name, p] : params) {
      register_parameter(name, p);
    }
  }
};

// Steps [from, to) of the judge's gradients.
void steps(std::map<std::string, at::Tensor>& params, Muon& opt, const Layout& l, int from,
           int to) {
  for (int k = from; k < to; ++k) {
    for (auto& [name, p] : params) {
      p.mutable_grad() = laid_out(judged("grad." + std::to_string(k) + "." + name), l, name);
    }
    opt.step();
  }
}

std::map<std::string, at::Tensor> params_on(const Layout& l,
                                            const std::map<std::string, at::Tensor>& full) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : full) {
    out[name] = laid_out(t, l, name).set_requires_grad(true);
  }
  return out;
}

} // namespace

TEST_CASE("Muon + AdamW equal PyTorch's on plain tensors and under FSDP and HSDP",
          "[world1][world2][world4][world8]") {
  const int64_t w = world();
  for (const std::string config : {"default", "variant"}) {
    SECTION("plain, " + config) {
      const Run r = run({DeviceMesh(), nullptr}, config);
      REQUIRE(r.all_to_alls == std::vector<int64_t>(kSteps, 0));
    }
    SECTION("FSDP, " + config) {
      // Every parameter Shard(0) (10 rows over 4 or 8 ranks: uneven, some ranks empty); the
      // experts whole on their ranks (dim 0 is their batch): one group, dp.
      const DeviceMesh mesh = init_device_mesh(device_type(), {w}, {"dp"});
      const Run r = run({mesh, [](const std::string&) { return Placements{Shard(0)}; }}, config);
      REQUIRE(r.all_to_alls == std::vector<int64_t>(kSteps, over(w, 2)));
    }
    SECTION("FSDP, Replicate gradients, " + config) {
      // The gradients' other placements are made the parameters' first (locally: no
      // communication beyond the exchange's).
      const DeviceMesh mesh = init_device_mesh(device_type(), {w}, {"dp"});
      Layout l{mesh, [](const std::string&) { return Placements{Shard(0)}; }};
      l.grad_placements = [](const std::string&) { return Placements{Replicate()}; };
      const Run r = run(l, config);
      REQUIRE(r.all_to_alls == std::vector<int64_t>(kSteps, over(w, 2)));
    }
    if (w >= 2) {
      SECTION("HSDP, " + config) {
        const DeviceMesh mesh = init_device_mesh(device_type(), {2, w / 2}, {"replicate", "shard"});
        const Run r = run({mesh,
                           [](const std::string&) {
                             return Placements{Replicate(), Shard(0)};
                           }},
                          config);
        REQUIRE(r.all_to_alls == std::vector<int64_t>(kSteps, over(w / 2, 2)));
      }
    }
  }
}

TEST_CASE("Muon + AdamW equal PyTorch's under FSDP x TP and EP x efsdp",
          "[world2][world4][world8]") {
  const int64_t w = world();
  for (const std::string config : {"default", "variant"}) {
    SECTION("FSDP x TP, " + config) {
      // Colwise (Shard(0) on tp, then dp) and rowwise (Shard(1) on tp) matrices: cut over
      // (tp, dp), one group of every rank; the experts' colwise Shard(1) over tp, their batch
      // over dp: the tp group.
      const DeviceMesh mesh = init_device_mesh(device_type(), {2, w / 2}, {"tp", "dp"});
      const auto placements = [](const std::string& name) {
        if (name == "tall" || name == "square_b" || name == "embed") {
          return Placements{Shard(1), Shard(0)};
        }
        if (name == "experts") {
          return Placements{Shard(1), Shard(0)};
        }
        if (name == "norm") {
          return Placements{Replicate(), Shard(0)};
        }
        return Placements{Shard(0), Shard(0)};
      };
      const Run r = run({mesh, placements}, config);
      // Groups (tp, dp) and tp, the same group on 2 ranks.
      REQUIRE(r.all_to_alls == std::vector<int64_t>(kSteps, w == 2 ? 2 : 4));
    }
    SECTION("EP x efsdp, " + config) {
      // Experts Shard(0) over ep (whole matrices there), Shard(1) over efsdp; the dense
      // matrices Shard(0) over efsdp. Without efsdp nothing moves.
      const int64_t ep = std::min<int64_t>(w, 4);
      const DeviceMesh mesh = init_device_mesh(device_type(), {ep, w / ep}, {"ep", "efsdp"});
      const auto placements = [](const std::string& name) {
        return name == "experts" ? Placements{Shard(0), Shard(1)}
                                 : Placements{Replicate(), Shard(0)};
      };
      const Run r = run({mesh, placements}, config);
      REQUIRE(r.all_to_alls == std::vector<int64_t>(kSteps, over(w / ep, 2)));
    }
  }
}

TEST_CASE("Muon + AdamW equal PyTorch's on pipeline stages", "[world2][world4][world8]") {
  const int64_t w = world();
  // Two stages, each FSDP over its half of the ranks, each rank's optimizer holding its stage's
  // parameters only.
  const DeviceMesh mesh = init_device_mesh(device_type(), {2, w / 2}, {"pp", "dp"});
  const bool first = mesh.get_local_rank("pp") == 0;
  Layout stage{mesh["dp"], [](const std::string&) { return Placements{Shard(0)}; }};
  stage.names = first ? std::vector<std::string>{"wide", "tall", "square_a", "norm"}
                      : std::vector<std::string>{"square_b", "odd", "experts", "embed"};
  const Run r = run(stage, "default");
  REQUIRE(r.all_to_alls == std::vector<int64_t>(kSteps, over(w / 2, 2)));
}

TEST_CASE("Muon's owner exchange: bytes exact, owners balanced",
          "[world1][world2][world4][world8]") {
  // Matrices whose rows every world size divides: each rank sends its piece of every matrix it
  // does not own, and receives the same back, in bf16.
  const int64_t w = world();
  const DeviceMesh mesh = init_device_mesh(device_type(), {w}, {"dp"});
  Layout l{mesh, [](const std::string&) { return Placements{Shard(0)}; }};
  l.names = {"wide", "tall", "square_a", "square_b"};
  const Run r = run(l, "default");
  if (w == 1) {
    REQUIRE(r.exchanges.empty());
    return;
  }
  REQUIRE(r.exchanges.size() == 1);
  const auto& e = r.exchanges[0];
  const int64_t elements = 8 * 24 + 24 * 8 + 16 * 16 * 2;
  REQUIRE(sum_over_ranks(e.bytes_to_owners) == 2 * elements * (w - 1) / w);
  REQUIRE(sum_over_ranks(e.bytes_from_owners) == 2 * elements * (w - 1) / w);
  REQUIRE(e.collectives == 2);
  // CommDebugMode counts what each rank sends: its pieces to the owners, the owners' pieces back.
  REQUIRE(sum_over_ranks(r.bytes_in) == 2 * 2 * elements * (w - 1) / w);
  // Greedy by cost from the costliest: the squares (16^3) on ranks 0 and 1, then wide and tall
  // (8 x 24 x 8 each) on the least loaded: ranks 0 and 1 again on 2 ranks, 2 and 3 on more.
  const std::vector<int64_t> owned = w == 2 ? std::vector<int64_t>{2, 2} : [&] {
    std::vector<int64_t> v(static_cast<size_t>(w), 0);
    std::fill(v.begin(), v.begin() + 4, 1);
    return v;
  }();
  REQUIRE(e.matrices == owned);
  REQUIRE(e.cost[0] == 16.0 * 16 * 16 + (w == 2 ? 8.0 * 24 * 8 : 0.0));
}

TEST_CASE("Muon refuses what torch.optim.Muon refuses, naming it", "[world1]") {
  at::Tensor v = at::zeros({4}, options()).set_requires_grad(true);
  REQUIRE_THROWS_WITH(Muon(std::vector<at::Tensor>{v}),
                      contains("a parameter of shape [4] belongs in an AdamW group"));
  at::Tensor m = at::zeros({4, 4}, options()).set_requires_grad(true);
  REQUIRE_THROWS_WITH(Muon({m}, MuonOptions().adjust_lr_fn("rms")),
                      contains("adjust_lr_fn 'rms' is not one of"));
  REQUIRE_THROWS_WITH(Muon({m}, MuonOptions().ns_steps(100)),
                      contains("ns_steps must be in [0, 100) (got 100)"));
  REQUIRE_THROWS_WITH(Muon({m}, MuonOptions(-1.0)), contains("lr must be >= 0 (got -1)"));
}

TEST_CASE("a Muon + AdamW state dict saved on one layout resumes on another: PyTorch's last step",
          "[world1][world2][world4][world8]") {
  // Two steps under FSDP, the optimizer's state dict (sharded, or full), the third step on
  // FSDP x TP (plain tensors on one rank): the parameters equal PyTorch's after three steps.
  const int64_t w = world();
  const DeviceMesh dp = init_device_mesh(device_type(), {w}, {"dp"});
  const Layout fsdp{dp, [](const std::string&) { return Placements{Shard(0)}; }};
  Layout other{DeviceMesh(), nullptr};
  if (w >= 2) {
    other.mesh = init_device_mesh(device_type(), {2, w / 2}, {"tp", "dp"});
    other.placements = [](const std::string& name) {
      return name == "tall" ? Placements{Shard(1), Shard(0)} : Placements{Shard(0), Replicate()};
    };
  }
  for (const std::string config : {"default", "variant"}) {
    for (const bool full : {false, true}) {
      INFO(config << (full ? ", full state dict" : ", sharded state dict"));
      std::map<std::string, at::Tensor> init;
      for (const auto& name : Layout{}.names) {
        init[name] = judged("init." + name);
      }
      auto a = params_on(fsdp, init);
      Named ma(a);
      Muon oa(groups(config, a));
      steps(a, oa, fsdp, 0, 2);
      const dtensor::StateDict sd = dtensor::get_optimizer_state_dict(
          ma, oa, dtensor::StateDictOptions().full_state_dict(full));
      REQUIRE(sd.contains("state.square_a.momentum_buffer"));
      REQUIRE(sd.contains("state.norm.exp_avg_sq"));
      REQUIRE(sd.contains("param_groups.odd.ns_coefficients"));
      REQUIRE(sd.contains("param_groups.embed.betas"));
      std::map<std::string, at::Tensor> now;
      for (const auto& [name, p] : a) {
        now[name] = (dtensor::is_dtensor(p) ? DTensor(p).full_tensor() : p).detach().clone();
      }
      auto b = params_on(other, now);
      Named mb(b);
      Muon ob(groups(config, b));
      dtensor::set_optimizer_state_dict(mb, ob, sd);
      steps(b, ob, other, 2, 3);
      for (const auto& [name, p] : b) {
        INFO(name);
        const at::Tensor got = dtensor::is_dtensor(p) ? DTensor(p).full_tensor() : p.detach();
        REQUIRE(same(got, judged(config + "." + name)));
      }
    }
  }
}
