"""The operator sweep: every aten call that PyTorch's OpInfo samples make (opinfo_record.py),
replayed through dtensor and through PyTorch's DTensor on several layouts, each judged
against the plain call on the full tensors.

Per call, the layouts (every tensor argument a DTensor; a name that does not fit a tensor,
Shard past its rank or Partial on integers, becomes Replicate):
  1-D mesh: all Replicate; Shard(d) on every tensor for each dim d of the first; Shard(0) on
            the first tensor only; Partial(sum) on the first floating tensor (its pieces are
            the value plus and minus noise, so an op that is not linear must reduce first).
  2-D mesh: (S0, S1), (R, S0), (S1, R) on every tensor; (P, R) on the first floating one.

Judged per case: a side is right when it runs and every output (tensors: shape, dtype, value
within TOL; scalars: equal) is the plain call's; it raises; or it is wrong. Per overload, a
side is right when it is right on every case. The scenario fails when dtensor gives a wrong
value anywhere (an error naming the op is allowed; a wrong value never), or when an overload
that PyTorch gets right is not right in dtensor (the coverage goal), unless listed in GAPS.

Scenario "sweep" (CI): one call per overload. "sweep_full" (scripts/sweep.sh): two.
"""
import json
import os

import torch
from torch.distributed.tensor import DTensor

from cases_util import assemble, chunk_sizes, coords, gen
from compare import _close
from opinfo_record import _decode, _outputs, record
from sc_ops import _call

TOL = (1e-4, 1e-5)
PER_OVERLOAD = 1
FLOATS = (torch.float32, torch.float64)

# Overloads that PyTorch's DTensor gets right and dtensor does not, with the reason. The
# coverage goal is that this stays empty.
GAPS = {}


def _fit(name, t):
    if name.startswith("S") and int(name[1:]) >= t.dim():
        return "R"
    if name.startswith("P") and t.dtype not in FLOATS:
        return "R"
    return name


def layouts(tensors, mesh):
    n = len(tensors)
    first = tensors[0]
    float_at = next((i for i, t in enumerate(tensors) if t.dtype in FLOATS), None)
    if len(mesh) == 1:
        out = [[("R",)] * n]
        out += [[(f"S{d}",)] * n for d in range(first.dim())]
        if n > 1:
            out.append([("S0",)] + [("R",)] * (n - 1))
        if float_at is not None:
            out.append([("P",) if i == float_at else ("R",) for i in range(n)])
    else:
        out = [[("S0", "S1")] * n, [("R", "S0")] * n, [("S1", "R")] * n]
        if float_at is not None:
            out.append([("P", "R") if i == float_at else ("R", "R") for i in range(n)])
    seen, kept = set(), []
    for lay in out:
        fitted = [[_fit(p, t) for p in names] for names, t in zip(lay, tensors)]
        if str(fitted) not in seen:
            seen.add(str(fitted))
            kept.append(fitted)
    return kept


def split(t, mesh, names, seed):
    """Each rank's piece of `t` (row-major mesh coordinates): Shard dims chunk it as
    torch.chunk does; a Partial(sum) dim splits it into value-minus-noise and noise pieces
    (and zeros on further ranks)."""
    out = []
    for c in coords(mesh):
        x = t
        for k, name in enumerate(names):
            if name.startswith("S"):
                d = int(name[1:])
                sizes = chunk_sizes(x.shape[d], mesh[k])
                x = x.narrow(d, sum(sizes[: c[k]]), sizes[c[k]])
        for k, name in enumerate(names):
            if name == "P":
                # Two pieces (value minus noise, noise) and zeros: their sum is the same in
                # any order (adding zero is exact), so ops with discontinuous outputs
                # (nonzero, unique) see the same value as the reference.
                noise = gen(list(x.shape), seed + 7 * k).to(x.dtype)
                x = x - noise if c[k] == 0 else noise if c[k] == 1 else torch.zeros_like(x)
        out.append(x.contiguous().clone())
    return out


def _mesh_tag(mesh):
    return "x".join(map(str, mesh))


def meshes(world):
    return [[1]] if world == 1 else [[2]] if world == 2 else [[4], [2, 2]]


def cases(world, per_overload=None):
    calls = record(per_overload or PER_OVERLOAD)
    out = []
    for j, call in enumerate(calls):
        ts = call["tensors"]
        for mesh in meshes(world):
            for lay in layouts(ts, mesh):
                ins = [{"shape": list(t.shape), "names": names,
                        "locals": split(t, mesh, names, 17 * i + 3)}
                       for i, (t, names) in enumerate(zip(ts, lay))]
                key = "{} c{} m{} {}".format(call["op"], j, _mesh_tag(mesh),
                                             " ".join(",".join(n) for n in lay))
                out.append({"key": key, "op": call["op"], "args": call["args"], "mesh": mesh,
                            "inputs": ins, "inplace": call["inplace"]})
    return out


def _flat(case, args, res):
    return [args[0]] if case["inplace"] else _outputs(res)


def reference(cases_):
    refs = {}
    for c in cases_:
        full = [assemble(i["locals"], c["mesh"], i["names"]) for i in c["inputs"]]
        args = [_decode(a, full) for a in c["args"]]
        try:
            res = _flat(c, args, _call(c["op"], args))
        except Exception:  # noqa: BLE001 - a layout's noise made the input invalid: not judged
            continue
        for k, v in enumerate(res):
            refs[f"{c['key']}#{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return refs


def _record(v):
    """What a side saw of one output (oracle.py's record format, computed inside the try)."""
    if isinstance(v, DTensor):
        return {"full": v.full_tensor().detach().clone(), "shape": list(v.shape)}
    if isinstance(v, torch.Tensor):
        return {"full": v.detach().clone(), "shape": list(v.shape)}
    return {"value": v}


def _torch_cannot_run(c):
    """Why PyTorch's ranks cannot run this case at all, or None. Such cases are not run on its
    side and are recorded as an error saying why."""
    layout = c["key"].split(" ", 3)[3]
    if c["op"] == "aten::_scaled_dot_product_flash_attention_for_cpu" and "P" in layout:
        return "not run: PyTorch's process aborts on it (Gloo, ranks out of step)"
    if any(t.numel() == 0 for i in c["inputs"] for t in i["locals"]):
        return ("not run: PyTorch's ranks fall out of step on empty shards (seen on 4 ranks: "
                "argmax hangs, the rank with the empty shard raising while the others wait in "
                "a collective; squeeze_copy aborts, a size-1 shard squeezed on one rank only)")
    return None


def run_torch(ctx, cases_):
    import sys
    from oracle import placements
    for c in cases_:
        if os.environ.get("CONFORMANCE_TRACE"):
            print(f"[rank {ctx.rank}] {c['key']}", file=sys.stderr, flush=True)
        why = _torch_cannot_run(c)
        if why:
            ctx.results.error(c["key"] + "#0", why)
            continue
        mesh = ctx.mesh(c["mesh"])
        err, recs = None, []
        try:
            ts = [DTensor.from_local(i["locals"][ctx.rank].clone(), mesh,
                                     placements(i["names"]), run_check=False,
                                     shape=torch.Size(i["shape"]),
                                     stride=torch.empty(i["shape"]).stride())
                  for i in c["inputs"]]
            args = [_decode(a, ts) for a in c["args"]]
            outs = _flat(c, args, _call(c["op"], args))
        except BaseException as e:  # noqa: BLE001 - the outcome is the result (AssertionError too)
            if isinstance(e, KeyboardInterrupt):
                raise
            err = e
        # A kernel can fail on one rank's (empty) shard only: agree before full_tensor's
        # collectives, and again after them.
        err = ctx.agree_error(err)
        if err is None:
            try:
                recs = [_record(v) for v in outs]
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt):
                    raise
                err = e
            err = ctx.agree_error(err)
        if err is not None:
            ctx.results.error(c["key"] + "#0", err)
            continue
        for k, rec in enumerate(recs):
            ctx.results.records[f"{c['key']}#{k}"] = rec


# ---- judging ------------------------------------------------------------------------------

def _right(rec, ref):
    if rec is None or "error" in rec:
        return None
    if isinstance(ref, torch.Tensor):
        got = rec.get("full")
        return isinstance(got, torch.Tensor) and _close(got, ref, TOL)[0]
    got = rec.get("value")
    if isinstance(ref, float) and isinstance(got, (int, float)):
        return abs(got - ref) <= TOL[1] + TOL[0] * abs(ref) or (got != got and ref != ref)
    return got == ref


def _case_of(key):
    return key.rsplit("#", 1)[0]


def _side(recs_by_rank, refs, case, nout):
    """'right', 'raises' (with the error) or 'wrong' (with what) for one case on one side."""
    for recs in recs_by_rank:
        if f"{case}#0" in recs and "error" in recs[f"{case}#0"]:
            err = recs[f"{case}#0"]["error"]
            return ("not run" if err.startswith("not run:") else "raises"), err
    for r, recs in enumerate(recs_by_rank):
        for k in range(nout):
            key = f"{case}#{k}"
            ok = _right(recs.get(key), refs[key])
            if not ok:
                return "wrong", f"rank {r} output {k}: " + (
                    "missing" if key not in recs else "not the plain op's value")
    return "right", ""


OUTCOMES = ("both right", "dtensor right, PyTorch not", "PyTorch right, dtensor not",
            "neither")


class SweepReport:
    def __init__(self, world):
        self.world = world
        self.cases = {}      # case key -> (dtensor status, detail, torch status, detail)
        self.overloads = {}  # op -> {"dtensor": status, "torch": status, "cases": n, ...}

    def add(self, case, d, dd, t, td):
        self.cases[case] = (d, dd, t, td)
        op = case.split()[0]
        o = self.overloads.setdefault(op, {"cases": 0, "dtensor": {}, "torch": {}, "why": ""})
        o["cases"] += 1
        o["dtensor"][d] = o["dtensor"].get(d, 0) + 1
        o["torch"][t] = o["torch"].get(t, 0) + 1
        if d != "right" and not o["why"]:
            o["why"] = f"{case.split(' ', 1)[1]}: {dd}"

    @staticmethod
    def status(counts):
        """Cases a side could not run (PyTorch's aborts and hangs) count neither way."""
        if counts.get("wrong"):
            return "wrong"
        ran = set(counts) - {"not run"}
        return "right" if ran == {"right"} else "raises"

    def outcome(self, op):
        d = self.status(self.overloads[op]["dtensor"]) == "right"
        t = self.status(self.overloads[op]["torch"]) == "right"
        return OUTCOMES[0 if d and t else 1 if d else 2 if t else 3]

    def failures(self):
        out = []
        for case, (d, dd, _, _) in self.cases.items():
            if d == "wrong":
                out.append(f"dtensor wrong: {case}: {dd}")
        for op in self.overloads:
            if self.outcome(op) == OUTCOMES[2] and op not in GAPS:
                out.append(f"coverage: PyTorch right, dtensor not: {op} ({self.overloads[op]['why']})")
        return out

    def ok(self):
        return not self.failures()

    def tally(self):
        t = {o: 0 for o in OUTCOMES}
        for op in self.overloads:
            t[self.outcome(op)] += 1
        return t

    def print(self):
        for f in self.failures():
            print("  " + f)
        n = len(self.overloads)
        right = sum(1 for op in self.overloads if self.status(self.overloads[op]["dtensor"]) == "right")
        print(f"[conformance] sweep w{self.world}: {len(self.cases)} cases over {n} overloads: "
              + ", ".join(f"{v} {k}" for k, v in self.tally().items())
              + f"; dtensor right on {right}/{n} ({100.0 * right / max(1, n):.1f}%)")

    def write_summary(self, directory, scenario, world):
        os.makedirs(directory, exist_ok=True)
        data = {"scenario": scenario, "world": world, "tally": self.tally(),
                "overloads": {op: dict(o, outcome=self.outcome(op))
                              for op, o in sorted(self.overloads.items())}}
        path = os.path.join(directory, f"{scenario}-w{world}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)


def judge(out, world):
    load = lambda p: torch.load(p, weights_only=False) if os.path.exists(p) else {}
    refs = load(os.path.join(out, "ref.pt"))
    sides = {s: [load(os.path.join(out, s, f"rank{r}.pt")) for r in range(world)]
             for s in ("dtensor", "torch")}
    nout = {}
    for key in refs:
        case = _case_of(key)
        nout[case] = max(nout.get(case, 0), int(key.rsplit("#", 1)[1]) + 1)
    report = SweepReport(world)
    for case in sorted(nout):
        d, dd = _side(sides["dtensor"], refs, case, nout[case])
        t, td = _side(sides["torch"], refs, case, nout[case])
        report.add(case, d, dd, t, td)
    return report
