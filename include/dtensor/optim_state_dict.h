#pragma once

// Optimizer state dicts keyed by parameter name, after PyTorch's get_optimizer_state_dict /
// set_optimizer_state_dict (torch.distributed.checkpoint.state_dict) in their flattened form:
//   "state.<fqn>.<field>"           exp_avg, exp_avg_sq, max_exp_avg_sq, step (Adam, AdamW),
//                                   momentum_buffer (SGD, Muon)
//   "param_groups.<fqn>.<option>"   lr, betas (a 2-element tensor), eps, weight_decay,
//                                   amsgrad, momentum, dampening, nesterov (0-dim tensors);
//                                   Muon's ns_coefficients (3 elements), ns_steps
// dtensor::optim::Muon (dtensor/muon.h) gives each parameter its group's kind: AdamW's
// fields and options in an AdamW group, Muon's in a Muon group.
// State of a DTensor parameter is a DTensor with the parameter's placements (no
// communication), or with full_state_dict its full value (one all-gather per tensor). `fqn`
// is the parameter's name in `module` (model state dict names). Works for plain modules,
// replicate, fully_shard (FSDP, HSDP), tensor parallelism and FSDP x TP.
#include <dtensor/state_dict.h>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace dtensor {

StateDict get_optimizer_state_dict(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& options = {});

// Loads `state` into the optimizer in place: missing per-parameter states are created (the
// optimizer may not have stepped yet); DTensor values are redistributed to the parameter's
// placements (on another mesh: gathered, one all-gather each, then cut), full values are cut
// to this rank's piece (no communication). An unknown name,
// a shape mismatch or a field the optimizer does not have is an error naming the key, raised
// before anything is written.
void set_optimizer_state_dict(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                              const StateDict& state, const StateDictOptions& options = {});

} // namespace dtensor
