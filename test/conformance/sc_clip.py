"""clip_grad_norm_ (norms 1, 2, 3, inf) over fully_shard gradients on 1-D and 2-D (HSDP)
meshes: the total norm, its collective counts and the clipped gradients; and model state
dicts (sharded and full: keys, placements, values; set_model_state_dict back)."""
import math
import warnings

import torch

warnings.filterwarnings("ignore")
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions, get_model_state_dict, set_model_state_dict)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.testing._internal.common_fsdp import MLPStack  # noqa: E402

from cases_util import gen  # noqa: E402

TOL = (1e-5, 1e-6)
NORMS = [1.0, 2.0, 3.0, math.inf]


def model():
    torch.manual_seed(0)
    return MLPStack(16)


def cases(world):
    layouts = ["1d"] + (["hsdp"] if world == 4 else [])
    init = {n: p.detach().clone() for n, p in model().named_parameters()}
    out = []
    for layout in layouts:
        xs = [gen([4, 16], 7 + r) for r in range(world)]
        for p in NORMS:
            out.append({"key": f"clip {layout} norm={p}", "kind": "clip", "layout": layout,
                        "norm": p, "inputs": xs, "init": init, "world": world})
        out.append({"key": f"state_dict {layout}", "kind": "state_dict", "layout": layout,
                    "init": init, "world": world})
    return out


def reference(cases):
    refs = {}
    for c in cases:
        m = model()
        if c["kind"] == "clip":
            torch.stack([m(x).sum() for x in c["inputs"]]).mean().backward()
            total = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, norm_type=c["norm"])
            refs[f"{c['key']} total#0"] = total.detach()
            for n, p in m.named_parameters():
                refs[f"{c['key']} grad {n}#0"] = p.grad.detach().clone()
        else:
            for n, p in m.named_parameters():
                refs[f"{c['key']} sharded {n}#0"] = p.detach()
                refs[f"{c['key']} full {n}#0"] = p.detach()
                refs[f"{c['key']} loaded {n}#0"] = p.detach() * 2
    return refs


def _sharded(ctx, c):
    m = model()
    mesh = ctx.mesh([2, ctx.world // 2], ["replicate", "shard"]) if c["layout"] == "hsdp" \
        else ctx.mesh([ctx.world], ["dp"])
    for b in m:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def run_torch(ctx, cases):
    for c in cases:
        m = _sharded(ctx, c)
        k = c["key"]
        if c["kind"] == "clip":
            m(c["inputs"][ctx.rank]).sum().backward()
            with CommDebugMode() as mode:
                total = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, norm_type=c["norm"])
            ctx.results.tensor(k + " total#0", total, mode)
            for n, p in m.named_parameters():
                ctx.results.tensor(f"{k} grad {n}#0", p.grad)
            continue
        sd = get_model_state_dict(m)
        ctx.results.value(k + " keys#0", list(sd.keys()))
        for n, v in sd.items():
            ctx.results.tensor(f"{k} sharded {n}#0", v)
        with CommDebugMode() as mode:
            full = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
        ctx.results.counts(k + " full counts#0", mode)
        for n, v in full.items():
            ctx.results.tensor(f"{k} full {n}#0", v)
        set_model_state_dict(m, {n: v * 2 for n, v in full.items()},
                             options=StateDictOptions(full_state_dict=True))
        for n, p in m.named_parameters():
            ctx.results.tensor(f"{k} loaded {n}#0", p)


REPLICATE_TOTAL = ("dtensor returns the total norm Replicate, reduced once and reused by the "
                   "clip (the flagship contract); PyTorch returns it still Partial and reduces a "
                   "copy, so reading it costs another all-reduce")


def by_design(key, t, d, what):
    if key.endswith("total#0") and what.startswith("placements") and "counts" not in what:
        return REPLICATE_TOTAL
    return None
