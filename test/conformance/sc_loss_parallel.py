"""Loss parallelism: cross_entropy on class-sharded logits under loss_parallel (PyTorch) /
dtensor::LossParallel, on a 1-D mesh and on (dp, tp) with the batch sharded over dp:
the loss and the logits' gradient (placements, values) and the collectives of forward and
backward; and log-probabilities that feed nll_loss and another op. Ignored rows (-100) in
every case, with and without class weights."""
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

from cases_util import gen

TOL = (1e-5, 1e-6)
ROWS, CLASSES = 12, 10  # 10 classes over 4 ranks: 3, 3, 3, 1


def _target():
    t = gen([ROWS], 5, torch.int64, high=CLASSES)
    t[2] = -100
    t[7] = -100
    return t


def cases(world):
    layouts = ["1d"] + (["2d"] if world == 4 else [])
    logits = gen([ROWS, CLASSES], 3) * 3
    weight = torch.linspace(0.5, 1.5, CLASSES)
    out = []
    for layout in layouts:
        for reduction in ("mean", "sum", "none"):
            for weighted in (False, True):
                out.append({"key": f"ce {layout} {reduction} w={int(weighted)}", "kind": "ce",
                            "layout": layout, "reduction": reduction, "weighted": weighted,
                            "logits": logits, "target": _target(), "weight": weight})
    out.append({"key": "twice 1d", "kind": "twice", "layout": "1d", "reduction": "mean",
                "weighted": False, "logits": logits, "target": _target(), "weight": weight})
    return out


def _loss(c, x, target):
    if c["kind"] == "twice":
        lp = F.log_softmax(x, 1)
        return F.nll_loss(lp, target) + lp.exp().pow(2).sum() * 0.01
    return F.cross_entropy(x, target, weight=c["weight"] if c["weighted"] else None,
                           reduction=c["reduction"])


def reference(cases):
    refs = {}
    for c in cases:
        x = c["logits"].clone().requires_grad_(True)
        loss = _loss(c, x, c["target"])
        loss.sum().backward()
        refs[c["key"] + " loss#0"] = loss.detach()
        refs[c["key"] + " grad#0"] = x.grad
    return refs


def run_torch(ctx, cases):
    for c in cases:
        k = c["key"]
        if c["layout"] == "1d":
            mesh = ctx.mesh([ctx.world], ["x"])
            x = distribute_tensor(c["logits"], mesh, [Shard(1)])
            target = c["target"]
        else:
            mesh = ctx.mesh([2, 2], ["dp", "tp"])
            x = distribute_tensor(c["logits"], mesh, [Shard(0), Shard(1)])
            target = distribute_tensor(c["target"], mesh, [Shard(0), Replicate()])
        x.requires_grad_(True)
        err = loss = None
        try:
            with loss_parallel():
                with CommDebugMode() as forward:
                    loss = _loss(c, x, target)
                with CommDebugMode() as backward:
                    loss.sum().backward()
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            err = e
        err = ctx.agree_error(err)
        if err is not None:  # neither a loss nor a gradient
            ctx.results.error(k + " loss#0", err)
            ctx.results.error(k + " grad#0", err)
            continue
        ctx.results.tensor(k + " loss#0", loss, forward)
        ctx.results.tensor(k + " grad#0", x.grad, backward)


ONE_RANK = ("one-rank mesh: PyTorch's loss_parallel all-reduces over a group of one rank; "
            "dtensor's skips collectives that have nothing to add. Values equal")


def by_design(key, t, d, what):
    # Only a group of one rank gives dtensor no collective at all in forward.
    if what.startswith("counts") and what.endswith("dtensor {}") and key.endswith("loss#0"):
        return ONE_RANK
    return None
