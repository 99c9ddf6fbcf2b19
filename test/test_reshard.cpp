// reshard: tensors move from one layout to another by point-to-point transfers. Guards the
// values (bit-equal to the full tensors, and to saving the source and loading the target), the
// bytes (each target piece receives exactly its elements its rank does not hold, counted by
// CommDebugMode), layouts on the same ranks and on disjoint ones, a dtype cast on the way, and
// bad input refused with the same error on every rank.
#include <filesystem>
#include <functional>
#include <map>

#include <torch/optim/adamw.h>

#include <dtensor/checkpoint.h>
#include <dtensor/optim_state_dict.h>
#include <dtensor/reshard.h>

#include "support/prelude.h"
#include <models/mlp_models.h>

using dtensor::Replicate;
using dtensor::Shard;
using dtensor::StateDict;

namespace {

// The full tensors every rank knows (the same seed everywhere).
std::map<std::string, at::Tensor> fulls() {
  at::manual_seed(7);
  return {{"a", at::randn({16, 24})},
          {"b", at::randn({10, 6})},
          {"experts", at::randn({4, 12, 8})},
          {"scale", at::randn({})}};
}

using Layout = std::function<Placements(const std::string&)>;

StateDict laid_out(const DeviceMesh& mesh, const Layout& layout,
                   c10::ScalarType dtype = at::kFloat) {
  StateDict out;
  for (const auto& [name, full] : fulls()) {
    out.insert(name, name == "scale" ? full.to(dtype).clone()
                                     : at::Tensor(dtensor::distribute_tensor(
                                           full.to(dtype), mesh, layout(name), std::nullopt)));
  }
  return out;
}

// The same names, allocated and zero, in a layout.
StateDict zeros_like(const StateDict& state) {
  StateDict out;
  for (const auto& item : state) {
    out.insert(item.key(), at::zeros_like(item.value()));
  }
  return out;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> box(const at::Tensor& t) {
  if (!dtensor::is_dtensor(t)) {
    return {std::vector<int64_t>(t.dim(), 0), t.sizes().vec()};
  }
  const auto& spec = DTensor(t).spec();
  return {spec.local_offset(), spec.local_shape()};
}

// The bytes a rank must receive: its target pieces' elements outside its own source pieces.
int64_t needed_bytes(const StateDict& source, const StateDict& target) {
  int64_t bytes = 0;
  for (const auto& item : target) {
    const auto [to, ts] = box(item.value());
    int64_t all = 1, held = 1;
    const auto* s = source.find(item.key());
    const auto from = s != nullptr ? box(*s) : std::make_pair(to, std::vector<int64_t>(to.size()));
    for (size_t d = 0; d < to.size(); ++d) {
      all *= ts[d];
      held *= std::max<int64_t>(0, std::min(to[d] + ts[d], from.first[d] + from.second[d]) -
                                       std::max(to[d], from.first[d]));
    }
    bytes += (all - (s != nullptr ? held : 0)) * item.value().element_size();
  }
  return bytes;
}

void require_full(const StateDict& target, c10::ScalarType dtype = at::kFloat) {
  for (const auto& [name, full] : fulls()) {
    INFO(name << " on rank " << rank());
    const at::Tensor& t = target[name];
    const at::Tensor got = dtensor::is_dtensor(t) ? DTensor(t).full_tensor() : t;
    REQUIRE(same(got, full.to(dtype)));
  }
}

torch::nn::Sequential hsdp_model(const DeviceMesh& mesh) {
  torch::manual_seed(0);
  auto m = dtensor::models::mlp_stack(8);
  for (const auto& child : m->children()) {
    dtensor::fully_shard(*child, FullyShardOptions().mesh(mesh));
  }
  dtensor::fully_shard(*m, FullyShardOptions().mesh(mesh));
  return m;
}

// One step on the batch of `seed` (the same on every rank); the loss.
double train_step(torch::nn::Sequential& m, torch::optim::Optimizer& opt, uint64_t seed) {
  torch::manual_seed(seed);
  const at::Tensor x = at::randn({4, 8}, options());
  opt.zero_grad();
  const at::Tensor loss = m->forward(x).pow(2).sum();
  loss.backward();
  opt.step();
  return loss.item<double>();
}

} // namespace

TEST_CASE("reshard between layouts on the same ranks: full values, the minimum bytes",
          "[world2][world4][world8]") {
  const int64_t w = world();
  const DeviceMesh flat = init_device_mesh(device_type(), {w}, {"dp"});
  const DeviceMesh grid = init_device_mesh(device_type(), {w / 2, 2}, {"dp", "tp"});
  const DeviceMesh ep = init_device_mesh(device_type(), {2, w / 2}, {"efsdp", "ep"});
  struct Case {
    const char* label;
    StateDict source;
    StateDict target;
  };
  std::vector<Case> cases;
  // FSDP -> TP: rows to columns (the experts' batch to their rows), one tensor replicated.
  cases.push_back({"FSDP -> TP",
                   laid_out(flat, [](const std::string&) { return Placements{Shard(0)}; }),
                   zeros_like(laid_out(flat, [](const std::string& n) {
                     return Placements{n == "b" ? Replicate() : Shard(1)};
                   }))});
  // FSDP x TP -> TP 2 replicas (each replica holds the whole tensor over its tp ranks).
  cases.push_back({"FSDP x TP -> TP replicas",
                   laid_out(grid,
                            [](const std::string&) {
                              return Placements{Shard(0), Shard(1)};
                            }),
                   zeros_like(laid_out(grid, [](const std::string&) {
                     return Placements{Replicate(), Shard(0)};
                   }))});
  // Experts over ep w/2 -> ep 2 (another mesh of the same ranks).
  cases.push_back({"EP -> EP",
                   laid_out(ep,
                            [](const std::string&) {
                              return Placements{Replicate(), Shard(0)};
                            }),
                   zeros_like(laid_out(grid, [](const std::string&) {
                     return Placements{Replicate(), Shard(0)};
                   }))});
  for (const Case& c : cases) {
    INFO(c.label);
    CommDebugMode mode;
    const dtensor::ReshardStats stats = dtensor::reshard(c.source, c.target);
    REQUIRE(stats.bytes_received == needed_bytes(c.source, c.target));
    REQUIRE((std::string(c.label) != "FSDP -> TP" || stats.bytes_received > 0));
    REQUIRE(mode.bytes_in(CollectiveKind::Send) == stats.bytes_sent);
    require_full(c.target);
  }
}

TEST_CASE("reshard from pipeline stages to one layout over every rank",
          "[world2][world4][world8]") {
  // Stage 0 holds "a" and "scale", stage 1 "b" and "experts", each FSDP over its half of the
  // ranks; the target is FSDP over every rank (pp 2 -> no pp).
  const int64_t w = world();
  const DeviceMesh stages = init_device_mesh(device_type(), {2, w / 2}, {"pp", "dp"});
  const bool first = stages.get_local_rank("pp") == 0;
  const StateDict all =
      laid_out(stages["dp"], [](const std::string&) { return Placements{Shard(0)}; });
  StateDict source;
  for (const auto& item : all) {
    const bool stage0 = item.key() == "a" || item.key() == "scale";
    if (stage0 == first) {
      source.insert(item.key(), item.value());
    }
  }
  const DeviceMesh flat = init_device_mesh(device_type(), {w}, {"dp"});
  const StateDict target =
      zeros_like(laid_out(flat, [](const std::string&) { return Placements{Shard(0)}; }));
  const dtensor::ReshardStats stats = dtensor::reshard(source, target);
  REQUIRE(stats.bytes_received == needed_bytes(source, target));
  require_full(target);
}

TEST_CASE("reshard equals saving the source and loading the target", "[world2][world4][world8]") {
  const int64_t w = world();
  const DeviceMesh flat = init_device_mesh(device_type(), {w}, {"dp"});
  const DeviceMesh grid = init_device_mesh(device_type(), {w / 2, 2}, {"dp", "tp"});
  const StateDict source = laid_out(flat, [](const std::string&) { return Placements{Shard(0)}; });
  const auto layout = [](const std::string& n) {
    return Placements{Shard(n == "experts" ? 2 : 1), Shard(0)};
  };
  const StateDict moved_here = zeros_like(laid_out(grid, layout));
  dtensor::reshard(source, moved_here);
  const std::string dir = dtensor::testing::fresh_shared_dir("reshard", "save_load");
  dtensor::checkpoint::save(source, dir);
  const StateDict loaded = zeros_like(laid_out(grid, layout));
  dtensor::checkpoint::load(loaded, dir);
  for (const auto& item : loaded) {
    INFO(item.key());
    const at::Tensor& a = moved_here[item.key()];
    REQUIRE(
        same(dtensor::is_dtensor(a) ? DTensor(a).to_local() : a,
             dtensor::is_dtensor(item.value()) ? DTensor(item.value()).to_local() : item.value()));
  }
}

TEST_CASE("reshard to other ranks, and cast on the way", "[world2][world4][world8]") {
  // The first half of the ranks trains (FSDP), the second half generates (TP): every element
  // of a generator's piece crosses once, from a trainer; in bf16, half the bytes.
  const int64_t w = world();
  const DeviceMesh roles = init_device_mesh(device_type(), {2, w / 2}, {"role", "x"});
  const bool trainer = roles.get_local_rank("role") == 0;
  const DeviceMesh mine = roles["x"];
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO(c10::toString(dtype));
    const StateDict source =
        trainer ? laid_out(mine, [](const std::string&) { return Placements{Shard(0)}; })
                : StateDict();
    const StateDict target =
        trainer ? StateDict()
                : zeros_like(laid_out(
                      mine, [](const std::string&) { return Placements{Shard(1)}; }, dtype));
    CommDebugMode mode;
    const dtensor::ReshardStats stats = dtensor::reshard(source, target);
    REQUIRE(stats.bytes_local == 0);
    REQUIRE(stats.bytes_received == needed_bytes(StateDict(), target));
    REQUIRE(mode.count(CollectiveKind::Send) == (trainer ? stats.peers : 0));
    if (!trainer) {
      require_full(target, dtype);
    }
  }
}

TEST_CASE("reshard refuses a target without a source, or of another shape, on every rank",
          "[world2][world4]") {
  const DeviceMesh flat = init_device_mesh(device_type(), {world()}, {"dp"});
  StateDict source;
  source.insert("a", at::Tensor(dtensor::distribute_tensor(at::ones({8, 4}), flat, {Shard(0)})));
  StateDict missing;
  missing.insert("b", at::zeros({8, 4}));
  REQUIRE_THROWS_WITH(dtensor::reshard(source, missing),
                      contains("reshard: no rank passes a source for target 'b'"));
  // One rank's bad piece is every rank's error, before anything moves.
  StateDict partial;
  partial.insert("a", rank() == 0 ? at::Tensor(DTensor::from_local(at::ones({8, 4}), flat,
                                                                   {dtensor::Partial()},
                                                                   std::vector<int64_t>{8, 4}))
                                  : source["a"]);
  REQUIRE_THROWS_WITH(dtensor::reshard(partial, missing),
                      contains("reshard: rank 0: source 'a' is Partial"));
  StateDict other;
  other.insert("a", at::zeros({4, 8}));
  REQUIRE_THROWS_WITH(dtensor::reshard(source, other),
                      contains("passes 'a' with global shape [4, 8] where another piece has "
                               "[8, 4]"));
}

TEST_CASE("healing: a restarted HSDP replica takes weights and optimizer state from its peer",
          "[world4][world8]") {
  // Replica 1 loses its state after 3 steps (fresh weights, a fresh AdamW); the surviving
  // replica's state dicts are the source, the restarted one's the target: each restarted rank
  // receives exactly its shards, and training goes on with the uninterrupted run's losses.
  const int64_t w = world();
  const DeviceMesh mesh = init_device_mesh(device_type(), {2, w / 2}, {"replicate", "shard"});
  auto ref = hsdp_model(mesh);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  auto m = hsdp_model(mesh);
  auto opt =
      std::make_unique<torch::optim::AdamW>(m->parameters(), torch::optim::AdamWOptions(1e-2));
  for (uint64_t s = 0; s < 3; ++s) {
    train_step(ref, ref_opt, s);
    train_step(m, *opt, s);
  }
  const bool restarted = mesh.get_local_rank("replicate") == 1;
  if (restarted) {
    at::NoGradGuard no_grad;
    for (auto& p : m->parameters()) {
      p.zero_();
    }
    opt = std::make_unique<torch::optim::AdamW>(m->parameters(), torch::optim::AdamWOptions(1e-2));
  }
  const dtensor::StateDict weights = dtensor::get_model_state_dict(*m);
  const dtensor::StateDict state = dtensor::get_optimizer_state_dict(*m, *opt);
  dtensor::StateDict all = weights;
  for (const auto& item : state) {
    all.insert(item.key(), item.value());
  }
  const dtensor::ReshardStats stats =
      dtensor::reshard(restarted ? StateDict() : all, restarted ? all : StateDict());
  REQUIRE(stats.bytes_received == (restarted ? needed_bytes(StateDict(), all) : 0));
  REQUIRE(stats.bytes_local == 0);
  // Collective (every rank; the surviving replica sets back what it has).
  dtensor::set_model_state_dict(*m, weights);
  dtensor::set_optimizer_state_dict(*m, *opt, state);
  for (uint64_t s = 3; s < 5; ++s) {
    INFO("step " << s);
    REQUIRE(train_step(m, *opt, s) == train_step(ref, ref_opt, s));
  }
}
