"""The DTensor factories (torch.distributed.tensor.zeros / ones / empty / full / rand /
randn): placements, global and local shapes, dtype, requires_grad, collective counts (none),
values where they are defined (zeros, ones, full, judged against the plain factory), and
bad input. rand / randn values are not compared: dtensor's are the same full tensor on every
layout (docs/random.md), PyTorch's on a CPU mesh are each rank's own draws; their record is
the shape and dtype (against shapes computed here), and for rand that every local value
lies in [0, 1) (#1). PyTorch 2.15 refuses rand / randn on a CPU mesh (a bare AssertionError:
no RNG tracker for the CPU)."""
import torch
import torch.distributed.tensor as dt
from torch.distributed.tensor.debug import CommDebugMode

SHAPES = {"a": [5, 4], "b": [3], "c": [2, 3, 5]}
FILL = 2.5


def meshes(world):
    return {1: [[1]], 2: [[2]], 4: [[4], [2, 2]]}[world]


def _placements(mesh, shape):
    ndim = len(shape)
    if len(mesh) == 1:
        return [["R"]] + [[f"S{d}"] for d in range(ndim)]
    out = [["R", "R"], ["R", "S0"], ["S0", "S0"]]
    if ndim > 1:
        out += [["S0", "S1"], ["S1", "R"]]
    return out


def cases(world):
    out = []
    for mesh in meshes(world):
        m = "x".join(map(str, mesh))
        for sname, shape in SHAPES.items():
            for pl in _placements(mesh, shape):
                for fac in ("zeros", "ones", "full", "empty", "rand", "randn"):
                    out.append({"key": f"mesh{m} {sname} {','.join(pl)} {fac}", "mesh": mesh,
                                "shape": shape, "placements": pl, "factory": fac,
                                "dtype": "float32", "requires_grad": False})
        # dtype and requires_grad, on the mesh's Shard(0)
        first = ["S0"] + ["R"] * (len(mesh) - 1)
        for fac in ("full", "randn", "zeros"):
            out.append({"key": f"mesh{m} a {','.join(first)} {fac} float64 rg", "mesh": mesh,
                        "shape": SHAPES["a"], "placements": first, "factory": fac,
                        "dtype": "float64", "requires_grad": True})
        # Partial: zeros keep their value; a constant or random draws under a sum would not
        for fac in ("zeros", "ones", "full", "rand"):
            pl = ["P"] + ["R"] * (len(mesh) - 1)
            out.append({"key": f"mesh{m} a {','.join(pl)} {fac}", "mesh": mesh,
                        "shape": SHAPES["a"], "placements": pl, "factory": fac,
                        "dtype": "float32", "requires_grad": False})
        # Bad input
        bad = [("err placements", SHAPES["a"], ["R"] * (len(mesh) + 1), "zeros", "float32"),
               ("err shard dim", SHAPES["b"], ["S1"] + ["R"] * (len(mesh) - 1), "ones", "float32"),
               ("err negative size", [-1, 4], ["R"] * len(mesh), "zeros", "float32"),
               ("err rand int", SHAPES["a"], ["R"] * len(mesh), "rand", "int64")]
        for name, shape, pl, fac, dtype in bad:
            out.append({"key": f"mesh{m} {name}", "mesh": mesh, "shape": shape,
                        "placements": pl, "factory": fac, "dtype": dtype,
                        "requires_grad": False})
    return out


def plain(c):
    dtype = getattr(torch, c["dtype"])
    return {"zeros": lambda: torch.zeros(c["shape"], dtype=dtype),
            "ones": lambda: torch.ones(c["shape"], dtype=dtype),
            "full": lambda: torch.full(c["shape"], FILL, dtype=dtype)}.get(c["factory"])


def _coordinate(rank, mesh):
    """Row-major coordinate of `rank` in a mesh of shape `mesh`."""
    out = []
    for size in reversed(mesh):
        out.append(rank % size)
        rank //= size
    return out[::-1]


def local_shape(shape, mesh, pls, rank):
    """This rank's piece, by torch.chunk's rule (ceil-sized pieces, the last ones shorter or
    empty), mesh dim by mesh dim: computed here, not asked of either library."""
    shape = list(shape)
    for size, coord, p in zip(mesh, _coordinate(rank, mesh), pls):
        if p.startswith("S"):
            d = int(p[1:])
            chunk = -(-shape[d] // size)
            shape[d] = max(0, min(chunk, shape[d] - coord * chunk))
    return shape


def reference(cases):
    refs = {}
    for c in cases:
        if c["key"].split(" ")[1] == "err":
            continue
        make = plain(c)
        if make is not None:
            refs[c["key"] + "#0"] = make()
            continue
        if "P" in c["placements"]:
            continue
        world = c["mesh"][0] * (c["mesh"][1] if len(c["mesh"]) > 1 else 1)
        for r in range(world):
            refs[f"{c['key']}#0@{r}"] = (
                f"{','.join(c['placements'])} {c['shape']} local "
                f"{local_shape(c['shape'], c['mesh'], c['placements'], r)} "
                f"torch.{c['dtype']} rg={c['requires_grad']}")
        if c["factory"] == "rand":
            refs[c["key"] + "#1"] = True  # every value in [0, 1)
    return refs


def describe(t):
    """Placements, global and local shape, dtype, requires_grad: one string, as the C++ side
    writes it."""
    from oracle import names_of
    return (f"{names_of(t.placements)} {list(t.shape)} local {list(t.to_local().shape)} "
            f"{t.dtype} rg={t.requires_grad}")


def run_torch(ctx, cases):
    from oracle import placements
    for c in cases:
        key = c["key"]
        mesh = ctx.mesh(c["mesh"], ["x"] if len(c["mesh"]) == 1 else ["dp", "tp"])
        kw = {"device_mesh": mesh, "placements": placements(c["placements"]),
              "dtype": getattr(torch, c["dtype"]), "requires_grad": c["requires_grad"]}
        fac = c["factory"]
        err, t = None, None
        try:
            with CommDebugMode() as m:
                if fac == "full":
                    t = dt.full(c["shape"], FILL, **kw)
                else:
                    t = getattr(dt, fac)(c["shape"], **kw)
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            err = e
        err = ctx.agree_error(err)
        if err is not None:
            ctx.results.error(key + "#0", err)
        elif fac in ("zeros", "ones", "full"):
            ctx.results.tensor(key + "#0", t, m)
        else:
            ctx.results.value(key + "#0", describe(t), m)
            if fac == "rand":
                local = t.to_local()
                ctx.results.value(key + "#1",
                                  bool(((local >= 0) & (local < 1)).all()))


PARTIAL_SUM = ("ones / full / rand with Partial(sum): PyTorch fills every rank's piece, so "
               "the value the DTensor stands for is world x the fill (or a sum of draws), not "
               "the plain factory's; dtensor refuses and names the placement (on every mesh "
               "size, a 1-rank mesh included, where the sum of one piece would be right: the "
               "layout should not decide whether a program is valid)")


def by_design(key, t, d, what):
    case = key.rsplit("#", 1)[0]
    if "P" in case.split(" ")[2].split(",") and what == "dtensor raises" and \
            any(case.endswith(f) for f in (" ones", " full", " rand")):
        return PARTIAL_SUM
    return None
