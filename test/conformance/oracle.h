#pragma once

// dtensor's side of the conformance suite (test/conformance/README.md): the scenario
// programs read the cases run.py wrote (DIR/cases.pt, torch.save format, read with
// torch::pickle_load) and write what they saw to DIR/dtensor/rank<r>.pt (torch::pickle_save,
// read back with torch.load), in the record format of oracle.py.
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <dtensor/all.h>

namespace conformance {

// One case: the dict run.py wrote.
class Case {
 public:
  explicit Case(c10::IValue v) : dict_(v.toGenericDict()) {}
  c10::IValue operator[](const std::string& field) const { return dict_.at(field); }
  bool has(const std::string& field) const { return dict_.contains(field); }
  std::string str(const std::string& field) const { return dict_.at(field).toStringRef(); }
  std::vector<int64_t> ints(const std::string& field) const;
  std::vector<std::string> strings(const std::string& field) const;
  at::Tensor tensor_at(const std::string& field, int64_t i) const;

 private:
  c10::impl::GenericDict dict_;
};

// Placement names shared with oracle.py: S0 S1 S2 R P Pavg Pmax Pmin.
dtensor::Placement placement(const std::string& name);
dtensor::Placements placements(const std::vector<std::string>& names);
std::string names_of(const dtensor::Placements& placements); // "S0,R"

// What one rank saw, by key.
class Results {
 public:
  // A DTensor (placements, local, full) or a plain tensor; counts when `mode` is given.
  void tensor(const std::string& key, const at::Tensor& t,
              const dtensor::CommDebugMode* mode = nullptr);
  void error(const std::string& key, const std::exception& e);
  void value(const std::string& key, const c10::IValue& v,
             const dtensor::CommDebugMode* mode = nullptr);
  void counts(const std::string& key, const dtensor::CommDebugMode& mode);
  // Every gradient, the optimizer step, then every parameter.
  void step(const std::string& key, torch::nn::Module& module, torch::optim::Optimizer& opt);
  void save(const std::string& path) const;

 private:
  c10::impl::GenericDict records_{c10::StringType::get(), c10::AnyType::get()};
};

struct Ctx {
  int64_t rank = 0;
  int64_t world = 1;
  std::string outdir;
  std::vector<Case> cases;
  Results results;
  // A mesh of `shape` over all ranks, named like oracle.py's (x; dp, tp), made once.
  dtensor::DeviceMesh mesh(const std::vector<int64_t>& shape, std::vector<std::string> names = {});
  // The first error any rank saw (another rank's as "on rank r: ..."), or none: one
  // all-reduce over all ranks, so every rank leaves with the same verdict.
  std::optional<std::string> agree_error(const std::optional<std::string>& mine);

 private:
  std::map<std::string, dtensor::DeviceMesh> meshes_;
};

// Copies the case's "init" (the Python model's initial values, by parameter name) into
// `module`'s parameters; a parameter without a value is an error naming it.
void load_init(torch::nn::Module& module, const Case& c);

using Scenario = std::function<void(Ctx&)>;
bool register_scenario(const std::string& name, Scenario run);

} // namespace conformance
