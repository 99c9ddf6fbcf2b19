"""Pipeline parallelism against PyTorch's torch.distributed.pipelining: the same
model cut into the same stages, the same schedule and microbatches on the same Gloo ranks;
each microbatch's loss on the last stage's rank and every gradient on the rank holding its
layer, against the plain model on one process (the reference) and PyTorch's run. The loss
contract, two ways on both sides: a sum over the microbatch divided by the global batch's
count with no rescaling of gradients afterwards (PyTorch's scale_grads=False), and a mean over
the microbatch with PyTorch's default (scale_grads=True: the gradients divided by the number of
microbatches after the last backward), which is dtensor's default too."""
import torch
import torch.nn as nn

from cases_util import gen

TOL = (1e-5, 1e-6)
LAYERS = 8
WIDTH = 8
BATCH = 16

# name -> (PyTorch's class name, stages per rank, placement: "loop" or "v")
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", 1, "loop"),
    "1F1B": ("Schedule1F1B", 1, "loop"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2, "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", 2, "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2, "v"),
    "DualPipeV": ("ScheduleDualPipeV", 2, "v"),
}


class Part(nn.Module):
    """Layers [first, last) of the model (Linear + tanh, the last layer without tanh), under
    their names in the whole model ("layers.3.weight")."""

    def __init__(self, layers, first, last):
        super().__init__()
        self.first, self.last = first, last
        self.layers = nn.ModuleDict({str(i): layers[i] for i in range(first, last)})

    def forward(self, x):
        for i in range(self.first, self.last):
            x = self.layers[str(i)](x)
            if i != LAYERS - 1:
                x = torch.tanh(x)
        return x


def model():
    torch.manual_seed(11)
    return Part([nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)], 0, LAYERS)


def sum_loss(out, target):
    return (out - target).pow(2).sum() / BATCH


def mean_loss(out, target):
    return (out - target).pow(2).mean()


LOSSES = {"sum": sum_loss, "mean": mean_loss}


def stages_of(rank, world, per_rank, placement):
    """The stage indices on `rank`, as the schedule's placement puts them."""
    if per_rank == 1:
        return [rank]
    if placement == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(per_rank)]


def cases(world):
    init = {n: p.detach().clone() for n, p in model().named_parameters()}
    micro = 2 * world  # DualPipeV needs at least two per stage of a rank
    return [{"key": f"{name} m={micro}" + ("" if loss == "sum" else " mean"), "schedule": name,
             "microbatches": micro, "loss": loss, "init": init, "input": gen([BATCH, WIDTH], 3),
             "target": gen([BATCH, WIDTH], 4)}
            for name in SCHEDULES for loss in LOSSES if world > 1]


def reference(cases):
    refs = {}
    for c in cases:
        loss_fn = LOSSES[c["loss"]]
        m = model()
        out = m(c["input"])
        m_out = out.chunk(c["microbatches"])
        for j, (o, t) in enumerate(zip(m_out, c["target"].chunk(c["microbatches"]))):
            refs[f"{c['key']} loss mb{j}#0"] = loss_fn(o, t).detach()
        loss_fn(out, c["target"]).backward()  # the mean over equal microbatches' means
        for n, p in m.named_parameters():
            refs[f"{c['key']} grad {n}#0"] = p.grad.detach().clone()
    return refs


def run_torch(ctx, cases):
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    for c in cases:
        cls, per_rank, placement = SCHEDULES[c["schedule"]]
        whole = model()
        whole.load_state_dict(c["init"])
        layers = [whole.layers[str(i)] for i in range(LAYERS)]
        num_stages = ctx.world * per_rank
        per_stage = LAYERS // num_stages
        mine = stages_of(ctx.rank, ctx.world, per_rank, placement)
        stages = [PipelineStage(Part(layers, s * per_stage, (s + 1) * per_stage), s, num_stages,
                                torch.device("cpu")) for s in mine]
        kind = getattr(pipelining, cls)
        sched = kind(stages[0] if per_rank == 1 else stages, c["microbatches"],
                     loss_fn=LOSSES[c["loss"]], scale_grads=c["loss"] == "mean")
        losses = []
        args = (c["input"],) if 0 in mine else ()
        target = c["target"] if num_stages - 1 in mine else None
        try:
            sched.step(*args, target=target, losses=losses)
        except Exception as e:  # noqa: BLE001 -- recorded for the comparison
            ctx.results.error(c["key"] + "#error", e)
            continue
        for j, loss in enumerate(losses):
            ctx.results.tensor(f"{c['key']} loss mb{j}#0", loss)
        for st in stages:
            for n, p in st.submod.named_parameters():
                ctx.results.tensor(f"{c['key']} grad {n}#0", p.grad)
