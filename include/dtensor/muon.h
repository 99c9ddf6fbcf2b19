#pragma once

// Muon (torch.optim.Muon's update) on parameters of any layout, with AdamW for the parameters
// Muon does not take, in one optimizer object. See docs/optimizers.md.
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

namespace torch::nn {
class Module;
}

namespace dtensor::optim {

// torch.optim.Muon's options and defaults. adjust_lr_fn: "original" (PyTorch's default, its
// None), "match_rms_adamw" or "spectral_unclamped".
struct MuonOptions : torch::optim::OptimizerCloneableOptions<MuonOptions> {
  using Coefficients = std::tuple<double, double, double>;
  MuonOptions(double lr = 1e-3); // NOLINT(google-explicit-constructor): as LibTorch's options
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.1;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(Coefficients, ns_coefficients) = {3.4445, -4.7750, 2.0315};
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;
  TORCH_ARG(std::string, adjust_lr_fn) = "original";

  double get_lr() const override { return lr(); }
  void set_lr(double value) override { lr(value); }
};

// A Muon parameter's state: its momentum buffer, in the parameter's layout (a DTensor with the
// parameter's placements when the parameter is one).
struct MuonParamState : torch::optim::OptimizerCloneableParamState<MuonParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);
};

// What one step moved for the matrices of one shard group ([Note: Muon's owners] in
// lib/train/muon/owners.cpp): the group (its label), how many matrices each group rank
// orthogonalised and their Newton-Schulz cost (rows x cols x min(rows, cols) summed), and the
// bytes this rank sent to owners and received back (bf16 elements, 2 bytes each).
struct MuonExchange {
  std::string group;
  std::vector<int64_t> matrices;
  std::vector<double> cost;
  int64_t bytes_to_owners = 0;
  int64_t bytes_from_owners = 0;
  int64_t collectives = 0; // all-to-alls issued (0 when every matrix is whole on its owner)
};

// One optimizer over two kinds of groups: a group whose options are torch::optim::AdamWOptions
// is stepped as torch.optim.AdamW (single-tensor form); every other group (MuonOptions, or no
// options: the defaults) as torch.optim.Muon. Muon groups take matrices (2-D) and batches of
// matrices (3-D, expert weights [E, out, in]: each [out, in] orthogonalised on its own).
// Parameters may be plain tensors or DTensors of any placements (the gradient's are made the
// parameter's first): the momentum stays in the parameter's layout; each matrix's update is
// gathered whole to one owner rank of the ranks sharding it, orthogonalised there, and the
// pieces sent back: one all-to-all each way per shard group, whatever the number of matrices.
// Every rank of a shard group must step the same parameters (the same ones with a gradient).
class Muon : public torch::optim::Optimizer {
 public:
  explicit Muon(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                MuonOptions defaults = {});
  explicit Muon(std::vector<at::Tensor> params, MuonOptions defaults = {});

  at::Tensor step(LossClosure closure = nullptr) override;

  // The exchanges of the last step, one per shard group, in the order they ran.
  const std::vector<MuonExchange>& last_exchanges() const { return last_; }

 private:
  std::vector<MuonExchange> last_;
};

// torchtitan's and Moonlight's split of a model: matrices (2-D and 3-D parameters) in a Muon
// group with `muon`, the rest (norms, biases) and every parameter whose name has a component
// in `adamw_names` (the embeddings and the output projection) in an AdamW group with `adamw`.
std::vector<torch::optim::OptimizerParamGroup>
muon_param_groups(const torch::nn::Module& module, const MuonOptions& muon,
                  const torch::optim::AdamWOptions& adamw,
                  const std::vector<std::string>& adamw_names = {"tok_embeddings", "output",
                                                                 "embed_tokens", "lm_head"});

} // namespace dtensor::optim
