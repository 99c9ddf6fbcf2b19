#include "oracle.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include <ATen/Parallel.h>
#include <torch/serialize.h>

#include <dtensor/collectives.h>
#include <dtensor/process_group.h>

namespace conformance {

std::vector<int64_t> Case::ints(const std::string& field) const {
  std::vector<int64_t> out; // unpickled lists are generic lists
  const c10::IValue list = dict_.at(field);
  for (const c10::IValue& v : list.toListRef()) {
    out.push_back(v.toInt());
  }
  return out;
}

std::vector<std::string> Case::strings(const std::string& field) const {
  std::vector<std::string> out;
  const c10::IValue list = dict_.at(field);
  for (const c10::IValue& v : list.toListRef()) {
    out.push_back(v.toStringRef());
  }
  return out;
}

at::Tensor Case::tensor_at(const std::string& field, int64_t i) const {
  const c10::IValue list = dict_.at(field);
  return list.toListRef().at(static_cast<size_t>(i)).toTensor();
}

dtensor::Placement placement(const std::string& name) {
  using dtensor::Placement;
  using dtensor::ReduceOp;
  static const std::map<std::string, Placement> table = {
      {"S0", Placement::shard(0)},
      {"S1", Placement::shard(1)},
      {"S2", Placement::shard(2)},
      {"S3", Placement::shard(3)},
      {"R", Placement::replicate()},
      {"P", Placement::partial(ReduceOp::Sum)},
      {"Pavg", Placement::partial(ReduceOp::Avg)},
      {"Pmax", Placement::partial(ReduceOp::Max)},
      {"Pmin", Placement::partial(ReduceOp::Min)}};
  auto it = table.find(name);
  if (it == table.end()) {
    throw std::invalid_argument("conformance: unknown placement name " + name);
  }
  return it->second;
}

dtensor::Placements placements(const std::vector<std::string>& names) {
  dtensor::Placements out;
  for (const auto& n : names) {
    out.push_back(placement(n));
  }
  return out;
}

namespace {

std::string name_of(const dtensor::Placement& p) {
  if (p.is_shard()) {
    return "S" + std::to_string(p.dim());
  }
  if (p.is_replicate()) {
    return "R";
  }
  if (p.is_partial()) {
    static const std::map<dtensor::ReduceOp, std::string> ops = {{dtensor::ReduceOp::Sum, "P"},
                                                                 {dtensor::ReduceOp::Avg, "Pavg"},
                                                                 {dtensor::ReduceOp::Max, "Pmax"},
                                                                 {dtensor::ReduceOp::Min, "Pmin"}};
    auto it = ops.find(p.reduce_op());
    return it != ops.end() ? it->second : p.to_string();
  }
  return p.to_string();
}

c10::impl::GenericDict counts_of(const dtensor::CommDebugMode& mode) {
  static const std::map<dtensor::CollectiveKind, std::string> kinds = {
      {dtensor::CollectiveKind::AllReduce, "all_reduce"},
      {dtensor::CollectiveKind::AllGather, "all_gather"},
      {dtensor::CollectiveKind::ReduceScatter, "reduce_scatter"},
      {dtensor::CollectiveKind::AllToAll, "all_to_all"},
      {dtensor::CollectiveKind::Broadcast, "broadcast"},
      {dtensor::CollectiveKind::Barrier, "barrier"},
      {dtensor::CollectiveKind::Send, "send"},
      {dtensor::CollectiveKind::Recv, "recv"}};
  c10::impl::GenericDict out(c10::StringType::get(), c10::IntType::get());
  for (const auto& [kind, n] : mode.comm_counts()) {
    if (n != 0) {
      out.insert(kinds.at(kind), n);
    }
  }
  return out;
}

} // namespace

std::string names_of(const dtensor::Placements& ps) {
  std::string out;
  for (const auto& p : ps) {
    out += (out.empty() ? "" : ",") + name_of(p);
  }
  return out;
}

void Results::tensor(const std::string& key, const at::Tensor& t,
                     const dtensor::CommDebugMode* mode) {
  c10::impl::GenericDict rec(c10::StringType::get(), c10::AnyType::get());
  if (mode != nullptr) {
    rec.insert("counts", counts_of(*mode)); // before full_tensor's own collectives
  }
  c10::NoGradGuard no_grad;
  if (dtensor::is_dtensor(t)) {
    dtensor::DTensor d(t);
    rec.insert("placements", names_of(d.placements()));
    rec.insert("local", d.to_local().detach().clone());
    rec.insert("full", d.full_tensor().detach().clone());
  } else {
    rec.insert("placements", std::string("plain"));
    rec.insert("local", t.detach().clone());
    rec.insert("full", t.detach().clone());
  }
  rec.insert("shape", t.sizes().vec());
  records_.insert_or_assign(key, rec);
}

void Results::error(const std::string& key, const std::exception& e) {
  c10::impl::GenericDict rec(c10::StringType::get(), c10::AnyType::get());
  std::string what = e.what();
  what = what.substr(0, what.find('\n')).substr(0, 300);
  rec.insert("error", what);
  records_.insert_or_assign(key, rec);
}

void Results::value(const std::string& key, const c10::IValue& v,
                    const dtensor::CommDebugMode* mode) {
  c10::impl::GenericDict rec(c10::StringType::get(), c10::AnyType::get());
  rec.insert("value", v);
  if (mode != nullptr) {
    rec.insert("counts", counts_of(*mode));
  }
  records_.insert_or_assign(key, rec);
}

void Results::counts(const std::string& key, const dtensor::CommDebugMode& mode) {
  c10::impl::GenericDict rec(c10::StringType::get(), c10::AnyType::get());
  rec.insert("counts", counts_of(mode));
  records_.insert_or_assign(key, rec);
}

void Results::step(const std::string& key, torch::nn::Module& module,
                   torch::optim::Optimizer& opt) {
  for (const auto& item : module.named_parameters()) {
    tensor(key + " grad " + item.key() + "#0", item.value().grad());
  }
  opt.step();
  for (const auto& item : module.named_parameters()) {
    tensor(key + " param " + item.key() + "#0", item.value());
  }
}

void Results::save(const std::string& path) const {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(records_));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f) {
      throw std::runtime_error("conformance: cannot write " + tmp);
    }
  }
  std::filesystem::rename(tmp, path);
}

dtensor::DeviceMesh Ctx::mesh(const std::vector<int64_t>& shape, std::vector<std::string> names) {
  if (names.empty()) {
    names =
        shape.size() == 1 ? std::vector<std::string>{"x"} : std::vector<std::string>{"dp", "tp"};
  }
  std::string key;
  for (auto s : shape) {
    key += std::to_string(s) + "x";
  }
  for (const auto& n : names) {
    key += n + ",";
  }
  auto it = meshes_.find(key);
  if (it == meshes_.end()) {
    it = meshes_.emplace(key, dtensor::init_device_mesh(c10::kCPU, shape, names)).first;
  }
  return it->second;
}

std::optional<std::string> Ctx::agree_error(const std::optional<std::string>& mine) {
  at::Tensor flags = at::zeros({world}, at::kFloat);
  if (mine) {
    flags[rank] = 1;
  }
  const at::Tensor seen =
      dtensor::DTensor::from_local(flags, mesh({world}), {dtensor::Placement::partial()})
          .full_tensor();
  for (int64_t r = 0; r < world; ++r) {
    if (seen[r].item<float>() > 0) {
      return r == rank ? *mine : "on rank " + std::to_string(r) + ": (its error)";
    }
  }
  return std::nullopt;
}

namespace {

std::map<std::string, Scenario>& scenarios() {
  static std::map<std::string, Scenario> s;
  return s;
}

std::vector<Case> read_cases(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    throw std::runtime_error("conformance: cannot read " + path);
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<Case> out;
  const c10::IValue all = torch::pickle_load(bytes); // kept alive while iterating
  for (const c10::IValue& v : all.toListRef()) {
    out.emplace_back(v);
  }
  return out;
}

} // namespace

bool register_scenario(const std::string& name, Scenario run) {
  scenarios()[name] = std::move(run);
  return true;
}

void load_init(torch::nn::Module& module, const Case& c) {
  const auto dict = c["init"].toGenericDict();
  torch::NoGradGuard no_grad;
  for (auto& item : module.named_parameters()) {
    TORCH_CHECK(dict.contains(item.key()), "no initial value for ", item.key());
    item.value().copy_(dict.at(item.key()).toTensor());
  }
}

} // namespace conformance

// conformance SCENARIO DIR, on the ranks torchrun started.
int main(int argc, char** argv) {
  using namespace conformance;
  if (argc != 3) {
    std::fprintf(stderr, "usage: conformance SCENARIO DIR\n");
    return 2;
  }
  try {
    at::set_num_threads(1);
    auto it = scenarios().find(argv[1]);
    if (it == scenarios().end()) {
      throw std::invalid_argument(std::string("conformance: unknown scenario ") + argv[1]);
    }
    dtensor::init_process_group();
    Ctx ctx;
    ctx.rank = dtensor::get_rank();
    ctx.world = dtensor::get_world_size();
    ctx.outdir = argv[2];
    ctx.cases = read_cases(ctx.outdir + "/cases.pt");
    it->second(ctx);
    ctx.results.save(ctx.outdir + "/dtensor/rank" + std::to_string(ctx.rank) + ".pt");
    dtensor::barrier(dtensor::world_group());
    dtensor::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "conformance %s: %s\n", argv[1], e.what());
    return 1;
  }
  return 0;
}
