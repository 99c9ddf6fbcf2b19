"""distribute_tensor / from_local / to_local / full_tensor / redistribute on the sub-meshes
(mesh["dp"], mesh["tp"]) of a 2-D mesh, on every rank. Each rank passes its own data to
distribute_tensor, so the values also show whose data the sub-mesh's source rank is
(PyTorch: the sub-mesh's first rank, src_data_rank=0)."""
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from cases_util import gen

SHAPE = [5, 4]


def meshes(world):
    return {1: [[1, 1]], 2: [[2, 1], [1, 2]], 4: [[2, 2]]}[world]


def cases(world):
    out = []
    for mesh in meshes(world):
        for sub in ("dp", "tp"):
            for pl in ("R", "S0", "S1"):
                key = f"mesh{mesh[0]}x{mesh[1]} {sub} {pl}"
                out.append({"key": key, "mesh": mesh, "sub": sub, "placement": pl,
                            "world": world})
    return out


def _groups(mesh, sub):
    """Global ranks of each rank's sub-mesh (row-major mesh of shape `mesh`)."""
    dp, tp = mesh
    out = {}
    for r in range(dp * tp):
        i, j = divmod(r, tp)
        out[r] = [i * tp + k for k in range(tp)] if sub == "tp" else [k * tp + j for k in range(dp)]
    return out


def data(rank):
    return gen(SHAPE, seed=rank + 1)


def reference(cases):
    refs = {}
    for c in cases:
        groups = _groups(c["mesh"], c["sub"])
        for r in range(c["world"]):
            src = data(groups[r][0])
            refs[f"{c['key']} distribute#0@{r}"] = src
            refs[f"{c['key']} redistribute R#0@{r}"] = src
            # from_local: each rank's own piece stands for its part of the global tensor
            pieces = [data(g) for g in groups[r]]
            if c["placement"] == "R":  # each rank's own data: full_tensor of Replicate is local
                refs[f"{c['key']} from_local#0@{r}"] = data(r)
            else:
                refs[f"{c['key']} from_local#0@{r}"] = torch.cat(pieces, int(c["placement"][1]))
    return refs


def run_torch(ctx, cases):
    from oracle import placement
    for c in cases:
        mesh = ctx.mesh(c["mesh"])[c["sub"]]
        p = placement(c["placement"])
        key = c["key"]
        with CommDebugMode() as m:
            d = distribute_tensor(data(ctx.rank), mesh, [p])
        ctx.results.tensor(key + " distribute#0", d, m)
        with CommDebugMode() as m:
            r = d.redistribute(mesh, [placement("R")])
        ctx.results.tensor(key + " redistribute R#0", r, m)
        ctx.results.tensor(key + " to_local#0", d.to_local())
        f = DTensor.from_local(data(ctx.rank), mesh, [p], run_check=False)
        ctx.results.tensor(key + " from_local#0", f)


SCATTER = ("distribute_tensor to Shard: dtensor broadcasts the tensor and each rank keeps its "
           "piece; PyTorch scatters the pieces (one collective either way; scatter moves fewer "
           "bytes)")


def by_design(key, t, d, what):
    if what == "counts: torch {'scatter': 1} dtensor {'broadcast': 1}":
        return SCATTER
    return None
