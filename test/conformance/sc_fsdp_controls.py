"""FSDP2's training-recipe controls on MLPStack (PyTorch's own test model): gradient
accumulation over 3 microbatches per step with set_requires_gradient_sync (1-D and HSDP),
set_requires_all_reduce (HSDP) and set_is_last_backward; an explicit unshard(async_op=True)
before each forward; mixed precision with output_dtype and cast_forward_inputs (fp32 inputs
and output around bf16 compute); post-accumulate-grad hooks doing the optimizer step in
backward. Per step: each microbatch's loss on each rank, the step's collective counts, the
gradients and the parameters after the step. The reference is the plain model on one
process: per step the sum over microbatches of the mean over ranks' losses."""
import warnings

import torch

warnings.filterwarnings("ignore")
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.testing._internal.common_fsdp import MLPStack  # noqa: E402

from cases_util import gen  # noqa: E402

STEPS = 2
MICRO = 3
LR = 1e-2


def model_of():
    torch.manual_seed(0)
    return MLPStack(16)


def configs(world):
    out = [("no_sync", "1d"), ("not_last_backward", "1d"), ("unshard_async", "1d"),
           ("output_dtype", "1d"), ("post_acc_hook", "1d")]
    if world == 4:
        out += [("no_sync", "hsdp"), ("no_all_reduce", "hsdp")]
    return out


def micro(mode):
    return 1 if mode in ("output_dtype", "post_acc_hook") else MICRO


def cases(world):
    init = {n: p.detach().clone() for n, p in model_of().named_parameters()}
    out = []
    for mode, layout in configs(world):
        xs = [[[gen([4, 16], 100 * s + 10 * m + r) for r in range(world)]
               for m in range(micro(mode))] for s in range(STEPS)]
        out.append({"key": f"{mode} {layout}", "mode": mode, "layout": layout, "world": world,
                    "init": init, "inputs": xs})
    return out


def reference(cases):
    refs = {}
    for c in cases:
        model = model_of()
        bf16 = c["mode"] == "output_dtype"
        low = model_of().to(torch.bfloat16) if bf16 else None
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for s, mbs in enumerate(c["inputs"]):
            k = f"{c['key']} step{s}"
            opt.zero_grad()
            if bf16:  # fp32 master weights, bf16 compute, fp32 output
                with torch.no_grad():
                    for p, q in zip(low.parameters(), model.parameters()):
                        p.copy_(q)
                low.zero_grad()
            for m, xs in enumerate(mbs):
                net = low if bf16 else model
                losses = [net(x.to(torch.bfloat16) if bf16 else x).float().sum() for x in xs]
                for r, loss in enumerate(losses):
                    refs[f"{k} mb{m} loss#0@{r}"] = loss.detach()
                refs[f"{k} mb{m} output dtype"] = "float32"
                torch.stack(losses).mean().backward()
            if bf16:
                for p, q in zip(model.parameters(), low.parameters()):
                    p.grad = q.grad.float()
            for n, p in model.named_parameters():
                refs[f"{k} grad {n}#0"] = p.grad.detach().clone()
            if c["mode"] == "post_acc_hook":
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(p.grad, alpha=LR)
            else:
                opt.step()
            for n, p in model.named_parameters():
                refs[f"{k} param {n}#0"] = p.detach().clone()
    return refs


def tolerance(key):
    return (5e-2, 5e-2) if "output_dtype" in key else (1e-4, 1e-5)


def set_flags(model, mode, last):
    if mode == "no_sync":
        model.set_requires_gradient_sync(last)
    elif mode == "no_all_reduce":
        model.set_requires_all_reduce(last)
    elif mode == "not_last_backward":
        model.set_is_last_backward(last)


def run_torch(ctx, cases):
    for c in cases:
        mode = c["mode"]
        model = model_of()
        if c["layout"] == "hsdp":
            mesh = ctx.mesh([2, ctx.world // 2], ["replicate", "shard"])
        else:
            mesh = ctx.mesh([ctx.world], ["dp"])
        if mode == "output_dtype":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32,
                                           output_dtype=torch.float32)
        else:
            mp = root_mp = MixedPrecisionPolicy()
        for b in model:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=root_mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        if mode == "post_acc_hook":
            def hook(p):
                with torch.no_grad():
                    p.sub_(p.grad, alpha=LR)
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(hook)
        for s, mbs in enumerate(c["inputs"]):
            k = f"{c['key']} step{s}"
            opt.zero_grad()
            with CommDebugMode() as cm:
                for m, xs in enumerate(mbs):
                    set_flags(model, mode, m == len(mbs) - 1)
                    if mode == "unshard_async":
                        model[0].unshard(async_op=True).wait()
                    out = model(xs[ctx.rank])
                    loss = out.sum()
                    loss.backward()
                    ctx.results.tensor(f"{k} mb{m} loss#0", loss.float())
                    ctx.results.value(f"{k} mb{m} output dtype", str(out.dtype).split(".")[-1])
            ctx.results.counts(f"{k} counts", cm)
            for n, p in model.named_parameters():
                ctx.results.tensor(f"{k} grad {n}#0", p.grad)
            if mode != "post_acc_hook":
                opt.step()
            for n, p in model.named_parameters():
                ctx.results.tensor(f"{k} param {n}#0", p)


LAST_UNIT = ("reshard after forward: dtensor frees a unit when forward moves on to another "
             "one, so the last unit stays unsharded into backward, which uses it first: one "
             "all-gather fewer per forward (PyTorch frees it after forward and gathers it again)")



NOT_LAST = ("set_is_last_backward(false): PyTorch keeps its post-forward order across such "
            "backwards (for pipeline schedules), and a later backward's prefetch fetches a unit "
            "once more: one all-gather more per step than the reshard rule above explains; "
            "dtensor prefetches by each forward's own order")


def by_design(key, t, d, what):
    tc, dc = t.get("counts", {}), d.get("counts", {})
    forwards = 1 if ("output_dtype" in key or "post_acc_hook" in key) else MICRO
    if what.startswith("counts") and ";" not in what and \
            tc.get("all_gather", 0) - dc.get("all_gather", 0) == forwards and \
            {k: v for k, v in tc.items() if k != "all_gather"} == \
            {k: v for k, v in dc.items() if k != "all_gather"}:
        return LAST_UNIT
    if what.startswith("counts") and ";" not in what and "not_last_backward" in key and \
            tc.get("all_gather", 0) - dc.get("all_gather", 0) == forwards + 1 and \
            {k: v for k, v in tc.items() if k != "all_gather"} == \
            {k: v for k, v in dc.items() if k != "all_gather"}:
        return NOT_LAST
    return None
