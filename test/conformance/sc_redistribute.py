"""Every redistribution between {S0, S1, R, P, Pavg, Pmax} on 1-D meshes (2 and 4 ranks)
and on a 2x2 mesh, even, uneven and with empty shards: values, placements and collective
counts."""
import itertools

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from cases_util import assemble, make_locals

PLACEMENTS = ["S0", "S1", "R", "P", "Pavg", "Pmax"]


def layouts(world):
    if world == 1:
        return [([1], [(4, 6), (0, 3)])]
    if world == 2:
        return [([2], [(4, 6), (5, 3)])]
    return [([4], [(8, 4), (3, 5)]), ([2, 2], [(4, 8), (5, 3)])]


def cases(world):
    out = []
    for mesh, shapes in layouts(world):
        combos = [list(c) for c in itertools.product(PLACEMENTS, repeat=len(mesh))]
        for shape in shapes:
            for i, src in enumerate(combos):
                locals_ = make_locals(shape, mesh, src, seed=i)
                for dst in combos:
                    key = "mesh{} {} {}->{}".format("x".join(map(str, mesh)),
                                                    "x".join(map(str, shape)),
                                                    ",".join(src), ",".join(dst))
                    out.append({"key": key, "mesh": mesh, "shape": list(shape), "src": src,
                                "dst": dst, "locals": locals_})
    return out


def reference(cases):
    return {c["key"]: assemble(c["locals"], c["mesh"], c["src"]) for c in cases}


def skip_torch(case):
    return None


def run_torch(ctx, cases):
    from oracle import placements
    for c in cases:
        mesh = ctx.mesh(c["mesh"])
        shape = torch.Size(c["shape"])
        stride = torch.empty(shape).stride()
        try:
            # PyTorch 2.15 refuses sources with mixed Partial reduce ops (sum and max) here.
            src = DTensor.from_local(c["locals"][ctx.rank], mesh, placements(c["src"]),
                                     run_check=False, shape=shape, stride=stride)
            with CommDebugMode() as m:
                out = src.redistribute(mesh, placements(c["dst"]))
            ctx.results.tensor(c["key"], out, m)
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            ctx.results.error(c["key"], e)


SUBSTITUTES = ("dtensor moves Shard(i)->Shard(j) with Gloo's all-to-all, where PyTorch's DTensor "
               "falls back to all-gather + chunk on CPU ('CPU process group does not support "
               "alltoall yet'), and Partial->Shard with one reduce-scatter where PyTorch (uneven "
               "shards) all-reduces and chunks: no more collectives, fewer bytes")


def by_design(key, t, d, what):
    """Differences that are intended (compare.py asks with what differs)."""
    if not what.startswith("counts") or ";" in what:
        return None
    tc, dc = t.get("counts", {}), d.get("counts", {})
    torch_only = {k for k in tc if tc[k] > dc.get(k, 0)}
    ours_only = {k for k in dc if dc[k] > tc.get(k, 0)}
    if sum(dc.values()) <= sum(tc.values()) and torch_only <= {"all_gather", "all_reduce"} and \
            ours_only <= {"all_to_all", "reduce_scatter"}:
        return SUBSTITUTES
    return None
