"""fully_shard training: MLPStack and the toy Transformer (PyTorch's own test models, from
torch.testing._internal), several AdamW steps, 1-D FSDP and HSDP, bf16 mixed precision,
reshard after forward on and off, activation checkpointing per block (full and selective:
checkpoint_wrapper in PyTorch, ModelArgs::activation_checkpoint in dtensor). Per step: each rank's loss, the step's collective counts,
every gradient and every parameter after the step. The reference is the plain model on one
process stepping on the mean of the ranks' losses."""
import warnings

import torch

warnings.filterwarnings("ignore")
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.testing._internal.common_fsdp import MLPStack  # noqa: E402
from torch.testing._internal.distributed._tensor.common_dtensor import (  # noqa: E402
    ModelArgs, Transformer)

from cases_util import gen  # noqa: E402

STEPS = 3
ARGS = dict(n_layers=2, vocab_size=8, max_seq_len=16, dim=16, n_heads=4, dropout_p=0.0)


def model_of(name):
    torch.manual_seed(0)
    return MLPStack(16) if name == "mlp" else Transformer(ModelArgs(**ARGS))


def blocks(model, name):
    return list(model) if name == "mlp" else list(model.layers)


def configs(world):
    out = [("mlp", "1d", True, "fp32"), ("mlp", "1d", False, "fp32"), ("mlp", "1d", True, "bf16"),
           ("transformer", "1d", True, "fp32"), ("transformer", "1d", False, "bf16"),
           ("transformer", "1d", True, "fp32 ac=full"), ("transformer", "1d", True, "fp32 ac=selective")]
    if world == 4:
        out += [("mlp", "hsdp", True, "fp32"), ("transformer", "hsdp", True, "fp32"),
                ("transformer", "hsdp", True, "fp32 ac=full")]
    return out


# Selective activation checkpointing: torchtitan's "op" policy, the matmuls and attention saved.
SAVED_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu")


def checkpointed(block, ac):
    """The block under checkpoint_wrapper (non-reentrant), as torchtitan applies AC."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    if ac == "full":
        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    saved = {getattr(torch.ops.aten, n).default for n in SAVED_OPS}

    def policy(ctx, op, *a, **k):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                              context_fn=lambda: create_selective_checkpoint_contexts(policy))


def inputs(name, world, step):
    if name == "mlp":
        return [gen([4, 16], 100 * step + r) for r in range(world)]
    return [(gen([2, 8], 100 * step + r).abs() * 1000).long().remainder(8) for r in range(world)]


def cases(world):
    out = []
    for name, layout, reshard, dtype in configs(world):
        key = f"{name} {layout} reshard={int(reshard)} {dtype}"
        out.append({"key": key, "model": name, "layout": layout, "reshard": reshard,
                    "dtype": dtype, "world": world,
                    "init": {n: p.detach().clone() for n, p in model_of(name).named_parameters()},
                    "inputs": [inputs(name, world, s) for s in range(STEPS)]})
    return out


def reference(cases):
    refs = {}
    for c in cases:
        model = model_of(c["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for s, xs in enumerate(c["inputs"]):
            opt.zero_grad()
            losses = [model(x).sum() for x in xs]
            for r, loss in enumerate(losses):
                refs[f"{c['key']} step{s} loss#0@{r}"] = loss.detach()
            torch.stack(losses).mean().backward()
            for n, p in model.named_parameters():
                refs[f"{c['key']} step{s} grad {n}#0"] = p.grad.detach().clone()
            opt.step()
            for n, p in model.named_parameters():
                refs[f"{c['key']} step{s} param {n}#0"] = p.detach().clone()
    return refs


def tolerance(key):
    # bf16 compute after AdamW steps: PyTorch and dtensor sit ~4e-2 from the fp32 reference
    # (compare.py also accepts 1.5x PyTorch's own distance), ~1e-2 from each other.
    return (5e-2, 5e-2) if "bf16" in key else (1e-4, 1e-5)


def run_torch(ctx, cases):
    for c in cases:
        name = c["model"]
        model = model_of(name)
        if c["layout"] == "hsdp":
            mesh = ctx.mesh([2, ctx.world // 2], ["replicate", "shard"])
        else:
            mesh = ctx.mesh([ctx.world], ["dp"])
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if c["dtype"] == "bf16" else MixedPrecisionPolicy()
        ac = c["dtype"].split("ac=")[1] if "ac=" in c["dtype"] else None
        for i, b in enumerate(blocks(model, name)):
            if ac:  # AC first, then fully_shard of the wrapper (torchtitan's order)
                b = checkpointed(b, ac)
                model.layers[i] = b
            fully_shard(b, mesh=mesh, reshard_after_forward=c["reshard"], mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=c["reshard"], mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for s, xs in enumerate(c["inputs"]):
            k = f"{c['key']} step{s}"
            opt.zero_grad()
            x = xs[ctx.rank]
            with CommDebugMode() as m:
                loss = model(x).sum()
                loss.backward()
            ctx.results.tensor(k + " loss#0", loss.float(), m)
            step(ctx, k, model, opt)


def step(ctx, key, model, opt):
    """Results.step, with checkpoint_wrapper's "_checkpoint_wrapped_module." left out of the
    names (dtensor checkpoints inside the block: its names do not change)."""
    def named():
        return [(n.replace("_checkpoint_wrapped_module.", ""), p)
                for n, p in model.named_parameters()]
    for n, p in named():
        ctx.results.tensor(f"{key} grad {n}#0", p.grad)
    opt.step()
    for n, p in named():
        ctx.results.tensor(f"{key} param {n}#0", p)


LAST_UNIT = ("reshard after forward: dtensor frees a unit when forward moves on to another "
             "one, so the last unit stays unsharded into backward, which uses it first: one "
             "all-gather fewer per step (PyTorch frees it after forward and gathers it again)")


def by_design(key, t, d, what):
    tc, dc = t.get("counts", {}), d.get("counts", {})
    if what.startswith("counts") and ";" not in what and "reshard=1" in key and \
            tc.get("all_gather", 0) - dc.get("all_gather", 0) == 1 and \
            {k: v for k, v in tc.items() if k != "all_gather"} == \
            {k: v for k, v in dc.items() if k != "all_gather"}:
        return LAST_UNIT
    return None
