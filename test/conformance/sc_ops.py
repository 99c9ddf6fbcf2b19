"""A corpus of aten ops on sharded inputs: output placements, values (against the plain op on
the full tensors) and collective counts. Both sides call the op through the dispatcher
(torch.ops.aten.X.overload / c10::Dispatcher), from the same argument list."""
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from cases_util import assemble, make_locals

TOL = (1e-5, 1e-5)


class T:
    """The i-th input tensor in an argument list (the C++ side reads {"t": i})."""

    def __init__(self, i):
        self.i = i


class TL:
    """A list of input tensors (cat, stack)."""

    def __init__(self, *idx):
        self.idx = list(idx)


F = "float"
L = "long"   # indices in [0, high)
B = "bool"

# (name, "aten::op.overload", args, inputs [(shape, dtype, high)], options)
#   options: linear=True also runs Partial(sum) inputs; dims=n restricts sharding to the
#   first n dims of every input; inplace=True records the first input after the op.
X = (4, 6)
CORPUS = [
    # pointwise, unary
    ("abs", "aten::abs", [T(0)], [(X, F)], {"linear": False}),
    ("neg", "aten::neg", [T(0)], [(X, F)], {"linear": True}),
    ("exp", "aten::exp", [T(0)], [(X, F)], {}),
    ("sin", "aten::sin", [T(0)], [(X, F)], {}),
    ("cos", "aten::cos", [T(0)], [(X, F)], {}),
    ("tanh", "aten::tanh", [T(0)], [(X, F)], {}),
    ("sigmoid", "aten::sigmoid", [T(0)], [(X, F)], {}),
    ("relu", "aten::relu", [T(0)], [(X, F)], {}),
    ("gelu", "aten::gelu", [T(0)], [(X, F)], {}),
    ("silu", "aten::silu", [T(0)], [(X, F)], {}),
    ("erf", "aten::erf", [T(0)], [(X, F)], {}),
    ("floor", "aten::floor", [T(0)], [(X, F)], {}),
    ("sign", "aten::sign", [T(0)], [(X, F)], {}),
    ("clamp", "aten::clamp", [T(0), -0.5, 0.5], [(X, F)], {}),
    ("pow_scalar", "aten::pow.Tensor_Scalar", [T(0), 2], [(X, F)], {}),
    ("mul_scalar", "aten::mul.Scalar", [T(0), 3.0], [(X, F)], {"linear": True}),
    ("leaky_relu", "aten::leaky_relu", [T(0), 0.1], [(X, F)], {}),
    ("hardtanh", "aten::hardtanh", [T(0), -1.0, 1.0], [(X, F)], {}),
    # pointwise, binary
    ("add", "aten::add.Tensor", [T(0), T(1)], [(X, F), (X, F)], {"linear": True}),
    ("add_alpha", "aten::add.Tensor", [T(0), T(1), 2.5], [(X, F), (X, F)], {}),
    ("sub", "aten::sub.Tensor", [T(0), T(1)], [(X, F), (X, F)], {"linear": True}),
    ("mul", "aten::mul.Tensor", [T(0), T(1)], [(X, F), (X, F)], {}),
    ("div", "aten::div.Tensor", [T(0), T(1)], [(X, F), (X, F)], {}),
    ("maximum", "aten::maximum", [T(0), T(1)], [(X, F), (X, F)], {}),
    ("add_bcast", "aten::add.Tensor", [T(0), T(1)], [(X, F), ((6,), F)], {}),
    ("mul_bcast", "aten::mul.Tensor", [T(0), T(1)], [(X, F), ((4, 1), F)], {}),
    ("gt", "aten::gt.Tensor", [T(0), T(1)], [(X, F), (X, F)], {}),
    ("lerp", "aten::lerp.Scalar", [T(0), T(1), 0.25], [(X, F), (X, F)], {}),
    ("addcmul", "aten::addcmul", [T(0), T(1), T(2)], [(X, F), (X, F), (X, F)], {}),
    ("where", "aten::where.self", [T(0), T(1), T(2)], [(X, B), (X, F), (X, F)], {}),
    ("masked_fill", "aten::masked_fill.Scalar", [T(0), T(1), 0.0], [(X, F), (X, B)], {}),
    # reductions
    ("sum", "aten::sum", [T(0)], [(X, F)], {"linear": True}),
    ("sum_dim0", "aten::sum.dim_IntList", [T(0), [0]], [(X, F)], {"linear": True}),
    ("sum_dim1_keep", "aten::sum.dim_IntList", [T(0), [1], True], [(X, F)], {"linear": True}),
    ("mean", "aten::mean", [T(0)], [(X, F)], {}),
    ("mean_dim0", "aten::mean.dim", [T(0), [0]], [(X, F)], {}),
    ("mean_dim0_uneven", "aten::mean.dim", [T(0), [0]], [((5, 6), F)], {}),
    ("amax_dim1", "aten::amax", [T(0), [1]], [(X, F)], {}),
    ("amin_dim0", "aten::amin", [T(0), [0]], [(X, F)], {}),
    ("max_dim", "aten::max.dim", [T(0), 1], [(X, F)], {}),
    ("argmax", "aten::argmax", [T(0), 0], [(X, F)], {}),
    ("prod_dim", "aten::prod.dim_int", [T(0), 1], [(X, F)], {}),
    ("norm", "aten::linalg_vector_norm", [T(0), 2.0], [(X, F)], {}),
    ("var", "aten::var.correction", [T(0), [1]], [(X, F)], {}),
    ("logsumexp", "aten::logsumexp", [T(0), [1]], [(X, F)], {}),
    ("cumsum", "aten::cumsum", [T(0), 1], [(X, F)], {}),
    ("any", "aten::any", [T(0)], [(X, B)], {}),
    # matmul
    ("mm", "aten::mm", [T(0), T(1)], [((4, 6), F), ((6, 8), F)], {}),
    ("addmm", "aten::addmm", [T(0), T(1), T(2)], [((8,), F), ((4, 6), F), ((6, 8), F)], {}),
    ("bmm", "aten::bmm", [T(0), T(1)], [((2, 4, 6), F), ((2, 6, 4), F)], {}),
    ("matmul", "aten::matmul", [T(0), T(1)], [((2, 4, 6), F), ((6, 4), F)], {}),
    ("linear", "aten::linear", [T(0), T(1), T(2)], [((4, 6), F), ((8, 6), F), ((8,), F)], {}),
    ("mv", "aten::mv", [T(0), T(1)], [((4, 6), F), ((6,), F)], {}),
    ("dot", "aten::dot", [T(0), T(1)], [((6,), F), ((6,), F)], {}),
    # views and reshapes
    ("view_merge", "aten::view", [T(0), [24]], [(X, F)], {}),
    ("view_split", "aten::view", [T(0), [4, 2, 3]], [(X, F)], {}),
    ("reshape_t", "aten::reshape", [T(0), [6, 4]], [(X, F)], {}),
    ("transpose", "aten::transpose.int", [T(0), 0, 1], [(X, F)], {}),
    ("t", "aten::t", [T(0)], [(X, F)], {}),
    ("permute", "aten::permute", [T(0), [2, 0, 1]], [((2, 4, 6), F)], {}),
    ("flatten", "aten::flatten.using_ints", [T(0), 0, 1], [((2, 4, 6), F)], {}),
    ("unsqueeze", "aten::unsqueeze", [T(0), 1], [(X, F)], {}),
    ("squeeze", "aten::squeeze.dim", [T(0), 1], [((4, 1, 6), F)], {}),
    ("expand", "aten::expand", [T(0), [3, 4, 6]], [((1, 4, 6), F)], {}),
    ("slice", "aten::slice.Tensor", [T(0), 1, 1, 5], [(X, F)], {}),
    ("select", "aten::select.int", [T(0), 0, 2], [(X, F)], {}),
    ("contiguous_t", "aten::clone", [T(0)], [(X, F)], {}),
    ("repeat", "aten::repeat", [T(0), [2, 1]], [(X, F)], {}),
    # nn
    ("softmax", "aten::_softmax", [T(0), 1, False], [(X, F)], {}),
    ("log_softmax", "aten::_log_softmax", [T(0), 0, False], [(X, F)], {}),
    ("layer_norm", "aten::native_layer_norm", [T(0), [6], T(1), T(2), 1e-5],
     [(X, F), ((6,), F), ((6,), F)], {}),
    ("embedding", "aten::embedding", [T(0), T(1)], [((10, 6), F), ((4, 3), L, 10)], {}),
    ("cross_entropy", "aten::cross_entropy_loss", [T(0), T(1)], [((4, 6), F), ((4,), L, 6)], {}),
    ("nll_loss", "aten::nll_loss", [T(0), T(1)], [((4, 6), F), ((4,), L, 6)], {}),
    ("mse_loss", "aten::mse_loss", [T(0), T(1)], [(X, F), (X, F)], {}),
    # cat / stack / split
    ("cat0", "aten::cat", [TL(0, 1), 0], [(X, F), ((2, 6), F)], {}),
    ("cat1", "aten::cat", [TL(0, 1), 1], [(X, F), ((4, 2), F)], {}),
    ("stack", "aten::stack", [TL(0, 1), 0], [(X, F), (X, F)], {}),
    ("split", "aten::split.Tensor", [T(0), 2, 1], [(X, F)], {}),
    ("chunk", "aten::chunk", [T(0), 2, 0], [(X, F)], {}),
    ("unbind", "aten::unbind.int", [T(0), 0], [((3, 6), F)], {}),
    # indexing
    ("index_select", "aten::index_select", [T(0), 1, T(1)], [(X, F), ((3,), L, 6)], {}),
    ("gather", "aten::gather", [T(0), 1, T(1)], [(X, F), ((4, 3), L, 6)], {}),
    ("topk", "aten::topk", [T(0), 2, 1], [(X, F)], {}),
    ("sort", "aten::sort", [T(0), 0], [(X, F)], {}),
    # factories
    ("zeros_like", "aten::zeros_like", [T(0)], [(X, F)], {}),
    ("ones_like", "aten::ones_like", [T(0)], [(X, F)], {}),
    ("full_like", "aten::full_like", [T(0), 7.0], [(X, F)], {}),
    ("new_zeros", "aten::new_zeros", [T(0), [3, 5]], [(X, F)], {}),
    ("new_ones", "aten::new_ones", [T(0), [2, 6]], [(X, F)], {}),
    # in-place
    ("add_", "aten::add_.Tensor", [T(0), T(1)], [(X, F), (X, F)], {"inplace": True}),
    ("mul_scalar_", "aten::mul_.Scalar", [T(0), 0.5], [(X, F)], {"inplace": True, "linear": True}),
    ("zero_", "aten::zero_", [T(0)], [(X, F)], {"inplace": True}),
    ("fill_", "aten::fill_.Scalar", [T(0), 2.0], [(X, F)], {"inplace": True}),
    ("copy_", "aten::copy_", [T(0), T(1)], [(X, F), (X, F)], {"inplace": True}),
    ("relu_", "aten::relu_", [T(0)], [(X, F)], {"inplace": True}),
    ("clamp_", "aten::clamp_", [T(0), -0.5, 0.5], [(X, F)], {"inplace": True}),
    ("addmm_bias_", "aten::add_.Tensor", [T(0), T(1)], [(X, F), ((6,), F)], {"inplace": True}),
]


def layouts_1d(n_inputs, linear):
    out = [["S0"] * n_inputs, ["S1"] * n_inputs, ["R"] * n_inputs]
    if n_inputs > 1:
        out += [["S0"] + ["R"] * (n_inputs - 1), ["R"] + ["S1"] * (n_inputs - 1)]
    if linear:
        out += [["P"] * n_inputs]
    return [[[p] for p in lay] for lay in out]


def layouts_2d(n_inputs, linear):
    base = [("S0", "S1"), ("R", "S0"), ("S1", "R"), ("S0", "S0")]
    out = [[list(b)] * n_inputs for b in base]
    if linear:
        out.append([["P", "S0"]] * n_inputs)
    return out


def fit(names, shape, dtype):
    """A layout fitted to an input: Shard dims beyond its rank become R; no Partial for
    integer / bool inputs."""
    out = []
    for n in names:
        if n.startswith("S") and int(n[1:]) >= len(shape):
            n = "R"
        if n.startswith("P") and dtype != F:
            n = "R"
        out.append(n)
    return out


def meshes(world):
    return [[1]] if world == 1 else [[2]] if world == 2 else [[4], [2, 2]]


def _gen_input(shape, dtype, high, mesh, names, seed):
    locals_ = make_locals(shape, mesh, names, seed)
    if dtype == L:
        locals_ = [(t.abs() * 1000).long().remainder(high) for t in locals_]
    elif dtype == B:
        locals_ = [t > 0 for t in locals_]
    return locals_


def encode(args):
    out = []
    for a in args:
        if isinstance(a, T):
            out.append({"t": a.i})
        elif isinstance(a, TL):
            out.append({"tl": a.idx})
        else:
            out.append(a)
    return out


def cases(world):
    out = []
    for mesh in meshes(world):
        for name, op, args, inputs, opts in CORPUS:
            lays = (layouts_1d if len(mesh) == 1 else layouts_2d)(len(inputs), opts.get("linear"))
            seen = set()
            for lay in lays:
                names = [fit(lay[i], spec[0], spec[1]) for i, spec in enumerate(inputs)]
                sig = str(names)
                if sig in seen:
                    continue
                seen.add(sig)
                ins = []
                for i, spec in enumerate(inputs):
                    shape, dtype = spec[0], spec[1]
                    high = spec[2] if len(spec) > 2 else None
                    # Integer / bool inputs must be the same wherever the layout says they
                    # are replicated: derive them from the float pattern.
                    ins.append({"shape": list(shape), "names": names[i], "dtype": dtype,
                                "locals": _gen_input(shape, dtype, high, mesh, names[i], 3 * i + 1)})
                key = "{} mesh{} {}".format(name, "x".join(map(str, mesh)),
                                            " ".join(",".join(n) for n in names))
                out.append({"key": key, "op": op, "args": encode(args), "mesh": mesh,
                            "inputs": ins, "inplace": bool(opts.get("inplace"))})
    return out


def _op(name):
    ns, rest = name.split("::")
    base, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns), base)
    return getattr(packet, overload or "default")


def _call(name, args):
    """The op with `args` in schema order (keyword-only ones passed by name)."""
    op = _op(name)
    pos, kw = [], {}
    for a, v in zip(op._schema.arguments, args):
        if a.kwarg_only:
            kw[a.name] = v
        else:
            pos.append(v)
    return op(*pos, **kw)


def _args(case, tensors):
    out = []
    for a in case["args"]:
        if isinstance(a, dict) and "t" in a:
            out.append(tensors[a["t"]])
        elif isinstance(a, dict) and "tl" in a:
            out.append([tensors[i] for i in a["tl"]])
        else:
            out.append(a)
    return out


def _outputs(case, args, result):
    if case["inplace"]:
        return [args[0]]
    if isinstance(result, (list, tuple)):
        return [r for r in result if isinstance(r, torch.Tensor)]
    return [result]


def reference(cases):
    refs = {}
    for c in cases:
        full = [assemble(i["locals"], c["mesh"], i["names"]) for i in c["inputs"]]
        args = _args(c, [f.clone() for f in full])
        res = _call(c["op"], args)
        for k, t in enumerate(_outputs(c, args, res)):
            refs[f"{c['key']}#{k}"] = t
    return refs


def run_torch(ctx, cases):
    import os
    import sys
    from oracle import placements
    for c in cases:
        if os.environ.get("CONFORMANCE_TRACE"):
            import datetime
            import torch.distributed as dist
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
            print(f"[rank {ctx.rank}] {c['key']}", file=sys.stderr, flush=True)
        mesh = ctx.mesh(c["mesh"])
        tensors = []
        for i in c["inputs"]:
            shape = torch.Size(i["shape"])
            tensors.append(DTensor.from_local(i["locals"][ctx.rank].clone(), mesh,
                                              placements(i["names"]), run_check=False,
                                              shape=shape, stride=torch.empty(shape).stride()))
        args = _args(c, tensors)
        err = None
        try:
            with CommDebugMode() as m:
                res = _call(c["op"], args)
            outs = _outputs(c, args, res)
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            err = e
        # PyTorch can raise on some ranks only (an empty shard): agree before any later
        # collective, or the ranks fall out of step and hang.
        err = ctx.agree_error(err)
        if err is not None:
            ctx.results.error(c["key"] + "#0", err)
            continue
        for k, t in enumerate(outs):
            ctx.results.tensor(f"{c['key']}#{k}", t, m if k == 0 else None)


FEWER = ("dtensor issues fewer collectives: it keeps a Shard where converting the other "
         "operand from Replicate is a local slice, where PyTorch's cost model gathers")
PARTIAL = ("dtensor keeps Partial(sum) through linear ops (negation, scalar multiply, sums and "
           "differences of Partials) and reduces once, later; PyTorch all-reduces each input "
           "first")
GATHER_DIM = ("dtensor gathers the reduced dim of max.dim / prod / any: PyTorch's Partial(max) "
              "leaves each shard's local indices (wrong, see 'PyTorch wrong' rows), and "
              "dtensor has no Partial(product) / Partial(or) placement")
LOSS = ("dtensor computes a mean loss on the whole batch; PyTorch's Partial(avg) of per-shard "
        "means is only right for even batch shards")
STRIDED = ("PyTorch 2.15 keeps a dimension merged from a sharded one as its _StridedShard placement "
           "(no collective); dtensor has no strided shard yet and gathers the merged dimension "
           "(one all-gather). Same value")
SPREAD = ("PyTorch 2.15 gathers the dimension the op needs whole and shards the output over a "
          "mesh dimension that was Replicate (a free local chunk); dtensor leaves that mesh "
          "dimension Replicate. The same collectives, the same value")
DECOMPOSE = ("PyTorch 2.15 runs ops without a sharding rule through their Python "
             "decomposition; dtensor's decomposition fallback runs C++ composite kernels, "
             "and mse_loss has its own CPU kernel (no composite one), so dtensor names the "
             "op without a rule")
STRATEGY = ("another sharding strategy with the same value: dtensor's rule follows the "
            "operands' own shards, PyTorch picks the cheapest of its strategies")


def _spread(torch_placements, ours):
    """Where the two differ, PyTorch has a Shard and dtensor Replicate."""
    a, b = torch_placements.split(","), ours.split(",")
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    return len(a) == len(b) and bool(diff) and all(x.startswith("S") and y == "R" for x, y in diff)


def by_design(key, t, d, what):
    """Differences that are intended, with the reason (compare.py asks with what differs)."""
    if "full values" in what:
        return None  # a different global value is never by design
    op, layout = key.split()[0], key.split()[2:]
    tc, dc = t.get("counts", {}), d.get("counts", {})
    if any("P" in part for part in layout) and op in (
            "neg", "mul_scalar", "sub", "add", "mul_scalar_", "sum", "sum_dim0", "sum_dim1_keep"):
        return PARTIAL
    if op == "mse_loss" and what == "dtensor raises":
        return DECOMPOSE
    if op in ("flatten", "view_merge") and "_StridedShard" in str(t.get("placements", "")):
        return STRIDED
    if "counts" not in what and _spread(str(t.get("placements", "")), str(d.get("placements", ""))):
        return SPREAD
    if op in ("max_dim", "prod_dim", "any"):
        return GATHER_DIM
    if op in ("cross_entropy", "nll_loss"):
        return LOSS
    if sum(dc.values()) < sum(tc.values()):
        return FEWER
    if op in ("addmm", "linear", "cat0", "stack", "gather", "index_select", "mul_bcast",
              "embedding", "bmm", "mv"):
        return STRATEGY
    return None
