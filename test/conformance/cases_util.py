"""Plain-torch helpers for building cases and their references (single process, no DTensor):
per-rank local tensors of a layout, and the global value they stand for."""
import itertools

import torch


def chunk_sizes(n, k):
    """torch.chunk's sizes of n rows over k ranks (trailing ones may be 0)."""
    size = -(-n // k) if n else 0
    return [max(0, min(size, n - i * size)) for i in range(k)]


def coords(mesh_shape):
    return list(itertools.product(*[range(s) for s in mesh_shape]))


def local_shape(global_shape, mesh_shape, names, coord):
    shape = list(global_shape)
    for dim, name in enumerate(names):
        if name.startswith("S"):
            d = int(name[1:])
            shape[d] = chunk_sizes(shape[d], mesh_shape[dim])[coord[dim]]
    return shape


def gen(shape, seed, dtype=torch.float32, high=None):
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.int64:
        return (torch.arange(n, dtype=torch.int64) * (7 + seed) + seed).remainder(high).reshape(shape)
    base = torch.arange(n, dtype=torch.float64) * (0.37 + 0.013 * seed) + 0.5 * seed
    return (base.sin() * 2).to(dtype).reshape(shape)


def make_locals(global_shape, mesh_shape, names, seed=0):
    """Each rank's local tensor (by global rank, row-major mesh) for a layout; values on
    Replicate dims agree, on Partial dims they differ (the value is their reduction)."""
    out = []
    for c in coords(mesh_shape):
        key = [c[i] if not names[i] == "R" else 0 for i in range(len(c))]
        # The seed depends on the coordinates that make pieces differ.
        s = seed * 1000 + sum(k * (10 ** i) for i, k in enumerate(key)) + 1
        out.append(gen(local_shape(global_shape, mesh_shape, names, c), s))
    return out


def _reduce(op, ts):
    st = torch.stack(ts)
    return {"P": st.sum(0), "Pavg": st.mean(0), "Pmax": st.amax(0), "Pmin": st.amin(0)}[op]


def assemble(locals_, mesh_shape, names):
    """The global value a layout's locals stand for: Partial mesh dims reduce first, in
    mesh-dim order (as redistributing to Replicate does: mixed reductions such as sum and
    max do not commute), then Shard dims concatenate with mesh dim 0 outermost."""
    grid = dict(zip(coords(mesh_shape), locals_))
    shape = list(mesh_shape)
    for k, name in enumerate(names):
        if name.startswith("P"):
            reduced = {}
            for c in grid:
                if c[k] == 0:
                    reduced[c] = _reduce(name, [grid[c[:k] + (i,) + c[k + 1:]]
                                                for i in range(shape[k])])
            grid = reduced

    def value(prefix):
        k = len(prefix)
        if k == len(mesh_shape):
            return grid[tuple(prefix)]
        name = names[k]
        if name == "R" or name.startswith("P"):
            return value(prefix + [0])
        return torch.cat([value(prefix + [i]) for i in range(mesh_shape[k])], int(name[1:]))

    return value([])
