"""Bad input: for each misuse, PyTorch's outcome and dtensor's (both raise, or both accept
with the same result)."""
import warnings

import torch
import torch.nn as nn

warnings.filterwarnings("ignore")
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions, set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import (DTensor, Partial, Replicate, Shard,  # noqa: E402
                                      distribute_tensor)
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module  # noqa: E402

NAMES = ["shard_dim_out_of_range", "too_many_placements", "redistribute_wrong_length",
         "from_local_wrong_length", "different_meshes", "plain_tensor_mixed",
         "mm_inner_mismatch", "view_bad_size", "fully_shard_twice", "colwise_on_layernorm",
         "clip_negative_max_norm", "state_dict_missing_key", "state_dict_wrong_shape",
         "mesh_larger_than_world", "partial_to_partial_max", "fully_shard_scalar_param",
         "parallelize_no_match", "cat_different_meshes", "fully_shard_module_on_stack"]


def cases(world):
    return [{"key": n, "world": world} for n in NAMES]


def reference(cases):
    world = cases[0]["world"]
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(16.0).view(4, 4) / 10)
        lin.bias.zero_()
    lin(torch.ones(2, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(lin.parameters(), -1.0)
    return {"clip_negative_max_norm#0": lin.weight.grad.detach(),
            "partial_to_partial_max#0": torch.ones(4) * (world * (world + 1) / 2)}


def run_torch(ctx, cases):
    for c in cases:
        name = c["key"]
        try:
            out = globals()["case_" + name](ctx)
            err = None
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            err = e
        err = ctx.agree_error(err)
        if err is not None:
            ctx.results.error(name + "#0", err)
        elif isinstance(out, torch.Tensor):
            ctx.results.tensor(name + "#0", out)
        else:
            ctx.results.value(name + "#0", "ok")


def mesh1(ctx):
    return ctx.mesh([ctx.world], ["x"])


def case_shard_dim_out_of_range(ctx):
    return distribute_tensor(torch.ones(4, 4), mesh1(ctx), [Shard(2)])


def case_too_many_placements(ctx):
    return distribute_tensor(torch.ones(4, 4), mesh1(ctx), [Shard(0), Replicate()])


def case_redistribute_wrong_length(ctx):
    d = distribute_tensor(torch.ones(4, 4), mesh1(ctx), [Shard(0)])
    return d.redistribute(mesh1(ctx), [Replicate(), Replicate()])


def case_from_local_wrong_length(ctx):
    return DTensor.from_local(torch.ones(2, 4), mesh1(ctx), [Shard(0), Shard(1)])


def case_different_meshes(ctx):
    a = distribute_tensor(torch.ones(4, 4), mesh1(ctx), [Shard(0)])
    b = distribute_tensor(torch.ones(4, 4), ctx.mesh([ctx.world], ["y"]), [Shard(0)])
    return a + b


def case_plain_tensor_mixed(ctx):
    return distribute_tensor(torch.ones(4, 4), mesh1(ctx), [Shard(0)]) + torch.ones(4, 4)


def case_mm_inner_mismatch(ctx):
    a = distribute_tensor(torch.ones(4, 6), mesh1(ctx), [Shard(0)])
    b = distribute_tensor(torch.ones(5, 4), mesh1(ctx), [Replicate()])
    return torch.mm(a, b)


def case_view_bad_size(ctx):
    return distribute_tensor(torch.ones(4, 6), mesh1(ctx), [Shard(0)]).view(5, 5)


def case_fully_shard_twice(ctx):
    m = nn.Linear(4, 4)
    fully_shard(m, mesh=mesh1(ctx))
    fully_shard(m, mesh=mesh1(ctx))


def case_colwise_on_layernorm(ctx):
    parallelize_module(nn.LayerNorm(4), mesh1(ctx), ColwiseParallel())


def case_clip_negative_max_norm(ctx):
    lin = nn.Linear(4, 4)
    torch.manual_seed(0)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(16.0).view(4, 4) / 10)
        lin.bias.zero_()
    fully_shard(lin, mesh=mesh1(ctx))
    lin(torch.ones(2, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(lin.parameters(), -1.0)
    return lin.weight.grad


def case_state_dict_missing_key(ctx):
    lin = nn.Linear(4, 4)
    fully_shard(lin, mesh=mesh1(ctx))
    set_model_state_dict(lin, {"weight": torch.ones(4, 4)},
                         options=StateDictOptions(full_state_dict=True))


def case_state_dict_wrong_shape(ctx):
    lin = nn.Linear(4, 4)
    fully_shard(lin, mesh=mesh1(ctx))
    set_model_state_dict(lin, {"weight": torch.ones(4, 5), "bias": torch.ones(4)},
                         options=StateDictOptions(full_state_dict=True))


def case_mesh_larger_than_world(ctx):
    init_device_mesh("cpu", (ctx.world + 1,))


def case_partial_to_partial_max(ctx):
    d = DTensor.from_local(torch.ones(4) * (ctx.rank + 1), mesh1(ctx), [Partial()])
    return d.redistribute(mesh1(ctx), [Partial("max")])


def case_fully_shard_scalar_param(ctx):
    m = nn.Module()
    m.scale = nn.Parameter(torch.tensor(2.0))
    fully_shard(m, mesh=mesh1(ctx))


def case_parallelize_no_match(ctx):
    m = nn.Sequential(nn.Linear(4, 4))
    parallelize_module(m, mesh1(ctx), {"missing": ColwiseParallel()})


def case_cat_different_meshes(ctx):
    a = distribute_tensor(torch.ones(4, 4), mesh1(ctx), [Replicate()])
    b = distribute_tensor(torch.ones(4, 4), ctx.mesh([ctx.world], ["y"]), [Replicate()])
    return torch.cat([a, b])


def case_fully_shard_module_on_stack(ctx):
    # C++ only (a module not owned by a shared_ptr); PyTorch's modules always are: it accepts.
    m = nn.Module()
    m.w = nn.Parameter(torch.ones(4))
    fully_shard(m, mesh=mesh1(ctx))


REFUSED = {
    "parallelize_no_match": "dtensor refuses a plan entry that matches no submodule (almost "
                            "always a typo); PyTorch only warns",
    "redistribute_wrong_length": "dtensor refuses target placements whose count differs from "
                                 "the mesh's dimensions; PyTorch does not check",
    "state_dict_missing_key": "dtensor refuses a state dict that lacks a parameter, naming it "
                              "(nothing half-loaded); PyTorch loads the rest",
    "cat_different_meshes": "dtensor refuses DTensors on different meshes in a tensor list as it "
                            "does for any other arguments; PyTorch 2.15 refuses them for add but "
                            "lets cat's list through (on the first tensor's mesh)",
    "fully_shard_module_on_stack": "C++ only: a module not owned by a std::shared_ptr cannot be "
                                   "registered; dtensor says so (PyTorch modules always are)",
}


def by_design(key, t, d, what):
    name = key.split("#")[0]
    if what == "dtensor raises" and name in REFUSED:
        return REFUSED[name]
    return None
