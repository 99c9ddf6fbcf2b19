#pragma once

// Model state dicts of modules with DTensor parameters (fully_shard, tensor parallelism),
// after torch.distributed.checkpoint.state_dict's get/set_model_state_dict.
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/ordered_dict.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor {

using StateDict = torch::OrderedDict<std::string, at::Tensor>;

struct StateDictOptions {
  // false: DTensor parameters appear as DTensors sharing the parameters' shards (no
  // communication). true: as full plain tensors (one all-gather per DTensor parameter).
  TORCH_ARG(bool, full_state_dict) = false;
  // Values are copied to the CPU; with full_state_dict only rank 0 keeps them (the other
  // ranks get an empty dict), as in PyTorch.
  TORCH_ARG(bool, cpu_offload) = false;
  // set_model_state_dict with a full state dict present on rank 0 only: each value is
  // broadcast from rank 0 (the other ranks may pass an empty dict).
  TORCH_ARG(bool, broadcast_from_rank0) = false;
};

// Parameters (a tied parameter once, under its first name) then buffers, by their names
// in `module`. Collective when full_state_dict is set.
StateDict get_model_state_dict(torch::nn::Module& module, const StateDictOptions& options = {});

// Copies `state` into the module's parameters and buffers in place (identities are kept,
// so optimizers stay valid). Accepts what get_model_state_dict returns in either form: a
// DTensor value is redistributed to the parameter's placements if they differ, a full
// value is cut to this rank's shard without communication. Every name must be present
// (on rank 0 only, with broadcast_from_rank0); an unknown or missing name, or a shape
// mismatch, is an error naming it.
void set_model_state_dict(torch::nn::Module& module, const StateDict& state,
                          const StateDictOptions& options = {});

} // namespace dtensor
