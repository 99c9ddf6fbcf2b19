"""Records the aten calls that PyTorch's own OpInfo samples make, for the operator sweep
(sc_sweep.py).

Every OpInfo of `torch.testing._internal.common_methods_invocations.op_db` that supports
float32 on CPU runs its samples on plain tensors under a TorchDispatchMode that records each
aten call it reaches (the op overload and its arguments in schema order, tensors cloned
before the call). A call is kept when it can be replayed by both sides and judged:

- aten namespace, functional or in-place on its first argument (no out= overloads);
- dense CPU tensors of float32 / float64 / int64 / int32 / bool in and out, inputs at most
  4-D and 4,096 elements (no complex numbers, no sparse or quantized tensors);
- deterministic: two runs on copies give the same outputs (random and uninitialized
  factories drop out here), no Generator argument;
- every argument encodable (tensors, lists of optional tensors, numbers, strings, dtypes,
  memory formats, layouts, devices).

Calls are deduplicated by (overload, argument signature); at most `per_overload` are kept for
each overload, preferring ones whose first tensor has 2 or more dimensions (so that sharding
each of two dims means something).

  python opinfo_record.py OUT.pt [--per-overload N] [--ops substr,...]   (for a look)
"""
import argparse
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

warnings.filterwarnings("ignore")

DTYPES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
          torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11,
          torch.bfloat16: 15}
TENSOR_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool)
MEMORY_FORMATS = {torch.contiguous_format: 0, torch.preserve_format: 1,
                  torch.channels_last: 2, torch.channels_last_3d: 3}
LAYOUTS = {torch.strided: 0}
MAX_NUMEL = 4096
MAX_DIM = 4
# Calls that are not ops on values: allocation, metadata, autograd plumbing.
SKIP = ("aten::detach", "aten::alias", "aten::lift_fresh", "aten::set_", "aten::resize_",
        "aten::_local_scalar_dense", "aten::empty", "aten::new_empty", "aten::lift",
        "aten::as_strided")
# Random draws: dtensor's are layout-independent (docs/random.md), never the plain op's.
RANDOM = ("rand", "normal", "bernoulli", "dropout", "multinomial", "poisson", "uniform",
          "exponential", "cauchy", "geometric", "log_normal")


class Unencodable(Exception):
    pass


def _fits(t):
    return (t.layout == torch.strided and t.device.type == "cpu" and t.dtype in TENSOR_DTYPES
            and t.dim() <= MAX_DIM and t.numel() <= MAX_NUMEL)


def _encode(v, tensors):
    """A JSON-like value (and the tensors it refers to by index) for one argument."""
    if isinstance(v, torch.Tensor):
        if not _fits(v):
            raise Unencodable(f"tensor {v.dtype} {tuple(v.shape)}")
        tensors.append(v.detach().clone())
        return {"t": len(tensors) - 1}
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        idx = []
        for x in v:
            if x is None:
                idx.append(None)
            elif isinstance(x, torch.Tensor):
                idx.append(_encode(x, tensors)["t"])
            else:
                raise Unencodable(f"list of {type(x).__name__}")
        return {"tl": idx}
    if isinstance(v, (list, tuple)):
        return [_encode(x, tensors) for x in v]
    if isinstance(v, torch.dtype):
        if v not in DTYPES:
            raise Unencodable(str(v))
        return {"dtype": DTYPES[v]}
    if isinstance(v, torch.memory_format):
        return {"mf": MEMORY_FORMATS[v]}
    if isinstance(v, torch.layout):
        if v not in LAYOUTS:
            raise Unencodable(str(v))
        return {"layout": LAYOUTS[v]}
    if isinstance(v, torch.device):
        if v.type != "cpu":
            raise Unencodable(str(v))
        return {"device": "cpu"}
    if isinstance(v, torch.SymInt):
        return int(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        if isinstance(v, float) and v != v:
            raise Unencodable("nan scalar")
        return v
    raise Unencodable(type(v).__name__)


def overload_name(func):
    s = func._schema
    return f"{s.name}.{s.overload_name}" if s.overload_name else s.name


def _schema_args(func, args, kwargs):
    """The arguments in schema order; a missing one takes its default."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out.append(args[i])
        elif a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise Unencodable(f"argument {a.name} missing")
    return out


def _kind(func):
    """'inplace' (writes its first argument), 'functional', or None (writes another)."""
    writes = [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not writes:
        return "functional"
    if len(writes) == 1 and writes[0] is func._schema.arguments[0] and not writes[0].kwarg_only:
        return "inplace"
    return None


def _outputs(res):
    if isinstance(res, torch.Tensor):
        return [res]
    if isinstance(res, (list, tuple)):
        return [x for r in res for x in _outputs(r)]
    return [res]


def _same(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(
                    x.nan_to_num(0.5) if x.is_floating_point() else x,
                    y.nan_to_num(0.5) if y.is_floating_point() else y):
                return False
        elif x != y:
            return False
    return True


def _replay(name, args):
    ns, rest = name.split("::")
    base, _, ov = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), base), ov or "default")


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = overload_name(func)
        rec = None
        if name.startswith("aten::") and not name.startswith(SKIP) and _kind(func) is not None \
                and not any(r in name for r in RANDOM) \
                and not any("Generator" in str(a.type) for a in func._schema.arguments):
            try:
                tensors = []
                encoded = [_encode(v, tensors) for v in _schema_args(func, args, kwargs)]
                if tensors and any(t.numel() > 0 for t in tensors):
                    rec = {"op": name, "args": encoded, "tensors": tensors,
                           "inplace": _kind(func) == "inplace"}
            except Unencodable:
                rec = None
        res = func(*args, **kwargs)
        if rec is not None:
            self.calls.append(rec)
        return res


def _deterministic(rec):
    """Runs the call twice on copies: the same outputs, all of them encodable."""
    from sc_ops import _call  # noqa: PLC0415 - the one place that calls by schema order
    outs = []
    for _ in range(2):
        ts = [t.clone() for t in rec["tensors"]]
        args = [_decode(a, ts) for a in rec["args"]]
        try:
            res = _call(rec["op"], args)
        except Exception:  # noqa: BLE001 - a call that fails on its own is not kept
            return False
        o = [args[0]] if rec["inplace"] else _outputs(res)
        if not all(isinstance(x, (torch.Tensor, bool, int, float)) for x in o):
            return False
        if any(isinstance(x, torch.Tensor) and (x.dtype not in TENSOR_DTYPES or
                                                x.layout != torch.strided) for x in o):
            return False
        outs.append([x.clone() if isinstance(x, torch.Tensor) else x for x in o])
    return _same(outs[0], outs[1])


def _decode(a, ts):
    if isinstance(a, dict):
        if "t" in a:
            return ts[a["t"]]
        if "tl" in a:
            return [None if i is None else ts[i] for i in a["tl"]]
        if "dtype" in a:
            return {v: k for k, v in DTYPES.items()}[a["dtype"]]
        if "mf" in a:
            return {v: k for k, v in MEMORY_FORMATS.items()}[a["mf"]]
        if "layout" in a:
            return torch.strided
        if "device" in a:
            return torch.device(a["device"])
    if isinstance(a, list):
        return [_decode(x, ts) for x in a]
    return a


def _signature(rec):
    return repr((rec["op"], [(tuple(t.shape), str(t.dtype)) for t in rec["tensors"]],
                 [a for a in rec["args"] if not isinstance(a, dict)]))


def record(per_overload=2, only=None):
    """The kept calls, grouped by overload (sorted by name), at most `per_overload` each."""
    from torch.testing._internal.common_methods_invocations import op_db
    torch.manual_seed(0)
    # Uninitialized memory (a sample made by torch.empty, as fill_'s input) reads as NaN in
    # deterministic mode, so the recorded calls are the same on every run and the oracle
    # cache, keyed on them ([Note: the oracle cache] in run.py), hits. warn_only: no sample
    # is lost to an op without a deterministic kernel.
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _record(op_db, per_overload, only)
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def _record(op_db, per_overload, only):
    by_op = {}
    seen = set()
    for info in op_db:
        if only and not any(s in info.name for s in only):
            continue
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        try:
            samples = list(info.sample_inputs("cpu", torch.float32))
        except Exception:  # noqa: BLE001 - an OpInfo that cannot make samples here
            continue
        for s in samples:
            rec_mode = Recorder()
            try:
                with rec_mode:
                    info(s.input, *s.args, **s.kwargs)
            except Exception:  # noqa: BLE001 - a sample that fails on plain tensors
                pass
            for rec in rec_mode.calls:
                sig = _signature(rec)
                if sig in seen:
                    continue
                seen.add(sig)
                by_op.setdefault(rec["op"], []).append(rec)
    out = []
    for name in sorted(by_op):
        calls = sorted(by_op[name], key=lambda r: (r["tensors"][0].dim() < 2,
                                                   r["tensors"][0].numel() == 0))
        kept = []
        for rec in calls:
            if len(kept) >= per_overload:
                break
            if _deterministic(rec):
                kept.append(rec)
        out += kept
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--per-overload", type=int, default=2)
    ap.add_argument("--ops", default="")
    a = ap.parse_args()
    calls = record(a.per_overload, [s for s in a.ops.split(",") if s] or None)
    torch.save(calls, a.out)
    print(f"{len(calls)} calls over {len({c['op'] for c in calls})} overloads -> {a.out}")


if __name__ == "__main__":
    main()
