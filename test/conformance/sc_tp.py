"""Tensor parallelism: parallelize_module plans on part of a model, the
styles' use_local_output / output_layouts, distribute_module, and FSDP x TP with parameters
distributed by hand (item 2). Two SGD steps each: outputs, per-step collective counts,
gradients and parameters, against the plain model on one process."""
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from cases_util import gen

TOL = (1e-5, 1e-5)
STEPS = 2


def seq_model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 8))


def linear_model():
    torch.manual_seed(3)
    return nn.Linear(8, 6)


PLANS = {
    "default": {},
    "dtensor_outputs": {"colwise_local": False, "rowwise_local": False},
    "rowwise_shard0": {"colwise_local": False, "rowwise_local": False, "rowwise_out": "S0"},
}


def cases(world):
    out = []
    for plan in PLANS:
        out.append({"key": f"tp_{plan}", "kind": "tp", "plan": plan,
                    "inputs": [gen([4, 16], 60 + s) for s in range(STEPS)]})
    mesh = {1: [1, 1], 2: [1, 2], 4: [2, 2]}[world]
    for p in ("R", "S0"):
        out.append({"key": f"fsdp_tp_hand_{p}", "kind": "fsdp_tp_hand", "placement": p,
                    "mesh": mesh, "inputs": [gen([4, 8], 40 + s) for s in range(STEPS)]})
    out.append({"key": "distribute_module", "kind": "distribute_module",
                "inputs": [gen([4, 8], 20 + s) for s in range(STEPS)]})
    return out


def _plain_run(c):
    """The plain model's records: output, grads and params per step (reference)."""
    refs = {}
    model = seq_model() if c["kind"] == "tp" else linear_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s, x in enumerate(c["inputs"]):
        opt.zero_grad()
        out = model(x)
        loss = out.pow(2).mean() if c["kind"] == "tp" else out.pow(2).sum()
        loss.backward()
        refs[f"{c['key']} step{s} out#0"] = out.detach()
        refs[f"{c['key']} step{s} loss#0"] = loss.detach()
        for n, p in model.named_parameters():
            refs[f"{c['key']} step{s} grad {n}#0"] = p.grad.detach().clone()
        opt.step()
        for n, p in model.named_parameters():
            refs[f"{c['key']} step{s} param {n}#0"] = p.detach().clone()
    return refs


def reference(cases):
    refs = {}
    for c in cases:
        refs.update(_plain_run(c))
        if c["kind"] == "fsdp_tp_hand":
            for n, p in linear_model().named_parameters():
                refs[f"{c['key']} sharded {n}#0"] = p.detach()
    return refs


def _build(ctx, c):
    from oracle import placement
    if c["kind"] == "tp":
        model = seq_model()
        mesh = ctx.mesh([ctx.world], ["tp"])
        o = PLANS[c["plan"]]
        row_out = Shard(0) if o.get("rowwise_out") == "S0" else Replicate()
        parallelize_module(model, mesh, {
            "0": ColwiseParallel(use_local_output=o.get("colwise_local", True)),
            "2": RowwiseParallel(output_layouts=row_out,
                                 use_local_output=o.get("rowwise_local", True))})
        return model, lambda x: x
    if c["kind"] == "distribute_module":
        from torch.distributed.tensor import distribute_module
        model = linear_model()
        mesh = ctx.mesh([ctx.world], ["tp"])

        def partition(name, mod, m):
            if isinstance(mod, nn.Linear):
                mod.weight = nn.Parameter(distribute_tensor(mod.weight, m, [Shard(0)]))
        distribute_module(model, mesh, partition)
        return model, lambda x: DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    from torch.distributed.fsdp import fully_shard
    model = linear_model()
    mesh = ctx.mesh(c["mesh"], ["dp", "tp"])
    tp = mesh["tp"]
    p = placement(c["placement"])
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), tp, [p]))
    model.bias = nn.Parameter(distribute_tensor(model.bias.detach(), tp, [p]))
    fully_shard(model, mesh=mesh["dp"])
    for n, q in model.named_parameters():
        ctx.results.tensor(f"{c['key']} sharded {n}#0", q)
    return model, lambda x: DTensor.from_local(x, tp, [Replicate()], run_check=False)


def run_torch(ctx, cases):
    for c in cases:
        try:
            _run_case(ctx, c)
            err = None
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            err = e
        err = ctx.agree_error(err)
        if err is not None:
            ctx.results.error(c["key"] + "#error", err)


def _run_case(ctx, c):
    model, wrap = _build(ctx, c)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if True:
        for s, x in enumerate(c["inputs"]):
            k = f"{c['key']} step{s}"
            opt.zero_grad()
            with CommDebugMode() as fwd:
                out = model(wrap(x))
            loss = out.pow(2).mean() if c["kind"] == "tp" else out.pow(2).sum()
            ctx.results.tensor(k + " out#0", out, fwd)
            ctx.results.tensor(k + " loss#0", loss)
            with CommDebugMode() as bwd:
                loss.backward()
            ctx.results.counts(k + " backward#0", bwd)
            ctx.results.step(k, model, opt)


MESH_ORDER = ("dtensor shards a tensor-parallel parameter over (tp, dp) with placements "
              "(T, Shard(0)); PyTorch over (dp, tp) with (Shard(0) or _StridedShard, T). Each "
              "rank holds the same piece (local values equal)")


def by_design(key, t, d, what):
    if "fsdp_tp_hand" in key and what.startswith("placements") and "full values" not in what \
            and "local values" not in what:
        return MESH_ORDER
    return None
