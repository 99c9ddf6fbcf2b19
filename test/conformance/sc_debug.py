"""Debugging views: visualize_sharding's table, and CommDebugMode per module on a
tensor-parallel model (the module-level tracing table, the JSON dump, sharding and parameter
info), each compared as text or values with what PyTorch prints for the same model. The
model's forward and backward values are checked against the plain model on one process.

Noise level 0 of the table and the JSON dump is compared whole. From level 1 on PyTorch
lists every aten call it saw (DTensor ones and the local ones DTensor runs) and prints its
Python class names; dtensor lists the DTensor operations its handler ran and C++ class names,
so at level 1 the module list, parameter placements and collective counts are compared
(lines naming module types or operations left out on both sides)."""
import contextlib
import io
import json
import os
import re

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode, visualize_sharding
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from cases_util import gen

TOL = (1e-5, 1e-5)
ANSI = re.compile(r"\x1B\[[0-?]*[ -/]*[@-~]")


class MLPModule(nn.Module):
    def __init__(self, seed=5):
        super().__init__()
        torch.manual_seed(seed)
        self.net1 = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class MLPModuleStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPModule(5), MLPModule(6)])
        torch.manual_seed(7)
        self.output = nn.Linear(10, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def vis_layouts(world):
    out = [([world], ("x",), p) for p in (["S0"], ["S1"], ["R"], ["P"])]
    if world >= 2:
        mesh = [2, world // 2]
        out += [(mesh, ("dp", "tp"), p) for p in (["S0", "S1"], ["S1", "S0"], ["S0", "S0"],
                                                   ["R", "S1"], ["P", "S0"])]
    return out


def cases(world):
    out = []
    for mesh, names, pls in vis_layouts(world):
        for shape in ([8, 6], [7, 5], [10], [3, 4], [0, 4], [2, 3, 4]):
            if any(p == "S1" for p in pls) and len(shape) < 2:
                continue
            key = f"vis mesh{'x'.join(map(str, mesh))} {'x'.join(map(str, shape))} {','.join(pls)}"
            out.append({"key": key, "kind": "vis", "mesh": mesh, "names": list(names),
                        "placements": pls, "shape": shape})
    for model in ("mlp", "stack"):
        out.append({"key": f"modules {model}", "kind": "modules", "model": model,
                    "input": gen([4, 10], 11)})
    return out


def plain_model(name):
    return MLPModule() if name == "mlp" else MLPModuleStack()


def reference(cases):
    refs = {}
    for c in cases:
        if c["kind"] != "modules":
            continue
        model = plain_model(c["model"])
        x = c["input"].clone().requires_grad_(True)
        out = model(x)
        out.sum().backward()
        refs[f"{c['key']} out#0"] = out.detach()
        refs[f"{c['key']} input grad#0"] = x.grad.detach()
    return refs


def module_lines(table):
    """The tracing table without ANSI colours, module types, operations and pass headers:
    module names (indented by depth), parameter placements, collective counts."""
    keep = []
    for line in ANSI.sub("", table).splitlines():
        s = line.strip()
        if s.startswith(("*module type", "**", "shape:", "sharding:", "device mesh:")) or \
                s in ("FORWARD PASS", "BACKWARD PASS", "ACTIVATION CHECKPOINTING"):
            continue
        keep.append(line)
    return "\n".join(keep)


def _vis(ctx, c):
    from oracle import placements
    mesh = ctx.mesh(c["mesh"], c["names"])
    full = gen(c["shape"], 3)
    pls = placements(c["placements"])
    if "P" in c["placements"]:
        t = DTensor.from_local(full, mesh, pls, run_check=False)
    else:
        t = distribute_tensor(full, mesh, pls)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        visualize_sharding(t)
    ctx.results.value(c["key"] + " printed#0", buf.getvalue())


def _modules(ctx, c):
    model = plain_model(c["model"])
    mesh = ctx.mesh([ctx.world], ["tp"])
    mlps = [model] if c["model"] == "mlp" else list(model.layers)
    for m in mlps:
        parallelize_module(m, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    x = c["input"].clone().requires_grad_(True)
    mode = CommDebugMode()
    with mode:
        out = model(x)
        out.sum().backward()
    k = c["key"]
    ctx.results.tensor(k + " out#0", out)
    ctx.results.tensor(k + " input grad#0", x.grad)
    ctx.results.value(k + " table0#0", mode.generate_comm_debug_tracing_table(noise_level=0))
    ctx.results.value(k + " table1 modules#0",
                      module_lines(mode.generate_comm_debug_tracing_table(noise_level=1)))
    path = os.path.join(ctx.outdir, f"torch-dump-{ctx.rank}.json")
    mode.generate_json_dump(path, noise_level=0)
    with open(path) as f:
        ctx.results.value(k + " json0#0", json.dumps(json.load(f), indent=4))
    ctx.results.value(k + " sharding#0", {n: str(p) for n, p in mode.get_sharding_info().items()})
    ctx.results.value(k + " parameters#0",
                      {m: sorted(ps) for m, ps in mode.get_parameter_info().items()})


def run_torch(ctx, cases):
    for c in cases:
        try:
            (_vis if c["kind"] == "vis" else _modules)(ctx, c)
            err = None
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            err = e
        err = ctx.agree_error(err)
        if err is not None:
            ctx.results.error(c["key"] + "#error", err)
