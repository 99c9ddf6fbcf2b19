"""PyTorch's side of the conformance suite: runs one scenario on the ranks torchrun started
and writes what it saw, rank by rank, for run.py to compare with dtensor's side.

Usage (run.py does this): torchrun --nproc-per-node N oracle.py SCENARIO DIR
Reads DIR/cases.pt (written by run.py from the scenario module's cases()), writes
DIR/torch/rank<r>.pt: {key: record}. A record is a dict with any of
  placements (str, canonical names below), shape (list), local (tensor), full (tensor),
  counts ({kind: n}), error (str), value (any small python value).
"""
import importlib
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

# Canonical placement names, shared with oracle.cpp.
NAMES = {"S0": Shard(0), "S1": Shard(1), "S2": Shard(2), "S3": Shard(3), "R": Replicate(),
         "P": Partial("sum"), "Pavg": Partial("avg"), "Pmax": Partial("max"),
         "Pmin": Partial("min")}


def placement(name):
    return NAMES[name]


def placements(names):
    return [placement(n) for n in names]


def name_of(p):
    if isinstance(p, Shard) and type(p) is Shard:
        return f"S{p.dim}"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return {"sum": "P", "avg": "Pavg", "max": "Pmax", "min": "Pmin"}.get(p.reduce_op, "P?")
    return repr(p)  # _StridedShard and others: shown as PyTorch spells them


def first_line(e):
    """An exception's first line, at most 200 characters (empty for an empty message)."""
    return (str(e).splitlines() or [""])[0][:200]


def names_of(ps):
    return ",".join(name_of(p) for p in ps)


# Substrings of PyTorch's op names (functional and c10d, underscores dropped) -> our kinds.
KINDS = [("allreduce", "all_reduce"), ("allgather", "all_gather"),
         ("reducescatter", "reduce_scatter"), ("alltoall", "all_to_all"),
         ("broadcast", "broadcast"), ("scatter", "scatter"), ("barrier", "barrier")]


def counts_of(mode):
    out = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).replace("_", "")
        for needle, kind in KINDS:
            if needle in name:
                out[kind] = out.get(kind, 0) + int(n)
                break
        else:
            out[name] = out.get(name, 0) + int(n)
    return {k: v for k, v in out.items() if v}


class Results:
    def __init__(self):
        self.records = {}

    def tensor(self, key, t, mode=None):
        rec = {}
        if isinstance(t, DTensor):
            rec["placements"] = names_of(t.placements)
            rec["local"] = t.to_local().detach().clone()
            rec["full"] = t.full_tensor().detach().clone()
        else:
            rec["placements"] = "plain"
            rec["local"] = t.detach().clone()
            rec["full"] = t.detach().clone()
        rec["shape"] = list(t.shape)
        if mode is not None:
            rec["counts"] = counts_of(mode)
        self.records[key] = rec

    def error(self, key, e):
        text = e if isinstance(e, str) else f"{type(e).__name__}: {first_line(e)}"
        self.records[key] = {"error": text}

    def value(self, key, v, mode=None):
        rec = {"value": v}
        if mode is not None:
            rec["counts"] = counts_of(mode)
        self.records[key] = rec

    def counts(self, key, mode):
        self.records[key] = {"counts": counts_of(mode)}

    def step(self, key, model, opt):
        """Every gradient, the optimizer step, then every parameter."""
        for n, p in model.named_parameters():
            self.tensor(f"{key} grad {n}#0", p.grad)
        opt.step()
        for n, p in model.named_parameters():
            self.tensor(f"{key} param {n}#0", p)

    def save(self, path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(self.records, path + ".tmp")
        os.replace(path + ".tmp", path)


class Ctx:
    def __init__(self, outdir):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.outdir = outdir
        self.results = Results()
        self._meshes = {}

    def agree_error(self, err):
        """The first error any rank saw (as seen from rank r: "on rank r: ..."), or None."""
        # One small all-reduce when no rank failed (the common case); the messages only then.
        flag = torch.tensor([0 if err is None else 1])
        dist.all_reduce(flag)
        if int(flag) == 0:
            return None
        seen = [None] * self.world
        mine = None if err is None else f"{type(err).__name__}: {first_line(err)}"
        dist.all_gather_object(seen, mine)
        for r, e in enumerate(seen):
            if e is not None:
                return e if r == self.rank else RuntimeError(f"on rank {r}: {e}")
        return None

    def mesh(self, shape, names=None):
        key = (tuple(shape), tuple(names or ()))
        if key not in self._meshes:
            if names is None:
                names = ("dp", "tp")[: len(shape)] if len(shape) > 1 else ("x",)
            self._meshes[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
        return self._meshes[key]


def run_scenario(scenario, outdir):
    mod = importlib.import_module("sc_" + scenario)
    cases = torch.load(os.path.join(outdir, "cases.pt"), weights_only=False)
    ctx = Ctx(outdir)
    mod.run_torch(ctx, cases)
    ctx.results.save(os.path.join(outdir, "torch", f"rank{ctx.rank}.pt"))
    dist.barrier()


def main():
    """oracle.py SCENARIO OUTDIR [SCENARIO OUTDIR ...]: one scenario per pair, in turn, in one
    process group ([Note: the oracle's batch] in prefill.py); after each, rank 0 writes
    OUTDIR/torch/done once every rank has saved its records."""
    pairs = list(zip(sys.argv[1::2], sys.argv[2::2]))
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    for scenario, outdir in pairs:
        run_scenario(scenario, outdir)
        if dist.get_rank() == 0:
            open(os.path.join(outdir, "torch", "done"), "w").write("")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
