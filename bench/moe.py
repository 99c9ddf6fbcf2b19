"""A training step of a stack of mixture-of-experts blocks with expert parallelism: dtensor
(bench/moe.cpp) side by side with the same model written with PyTorch 2.15's public API, on
the same CPU ranks, alternating in one run.

Driver:  python bench/moe.py TORCHRUN BENCH_BIN [--rounds R] [--layouts 2:2 4:4 4:2]
                 [--live-bytes build/bench/liblive_bytes.so] [--dispatch] [model flags]
Worker:  torchrun ... bench/moe.py --worker --ep N [model flags]   (PyTorch's side)

The model (both sides): --layers blocks x + MoE(RMSNorm(x)); the MoE layer as
models/moe/moe.h: an fp32 gate, softmax scores, top-k, the k scores normalised, the
(token, choice) pairs sorted by expert (stable), routed SwiGLU experts w1 / w3 [E, F, D],
w2 [E, D, F] through torch._grouped_mm, a shared SwiGLU expert, each pair's output times its
score summed back into its token; no load-balancing bias. Parallelism, as torchtitan's: the
experts Shard(0) over "ep" of the sparse mesh (efsdp, ep), with the counts exchanged by one
all-to-all, the rows dispatched and combined by all_to_all_single with autograd and
permuted expert-major between; fully_shard of the experts over efsdp (gradients divided by
the world, as the rest; PyTorch's with efsdp > 1 by efsdp, since its other divide factors
reduce with PREMUL_SUM, which Gloo lacks: a constant factor on the experts' gradients, the
same work) and of each block and the root over the world. A step: --tokens rows
per rank, loss sum(out * g) / rows, backward, AdamW (lr 1e-3). PyTorch's dispatcher turns
the splits into Python lists (.tolist(), torchtitan's device-to-host sync) and permutes with
an argsort; dtensor's is ExpertParallel.

Per layout ("ranks:ep") and round: PyTorch, then dtensor, then dtensor without the router's
early count exchange. A run's figure is the median of its timed steps; the table gives the
median over rounds (min-max); ratios are medians of per-round ratios. Wait: the time a
layer's experts call waits for its split sizes, per layer per step (the largest rank's mean):
dtensor with the exchange started by the router (overlapping the shared expert) and without.
Memory (with --live-bytes): one more run of each side, preloaded: the largest rank's peak of
live tensor bytes over the timed steps (bench/live_bytes.cpp).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_util import live_bytes  # bench/bench_util.py (this script's folder)


# The matrix-product kernels (torch._grouped_mm on CPU loops over aten::mm per group).
PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm"}


def worker(a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (world // a.ep, a.ep), mesh_dim_names=("efsdp", "ep"))
    ep_group = sparse["ep"].get_group()
    E, El, K = a.experts, a.experts // a.ep, a.top_k
    waited = [0.0]

    def grouped_mm(x, w, counts):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    from torch_llama3 import FeedForward, RMSNorm  # noqa: PLC0415 (the recipe benchmark's layers)

    class Experts(nn.Module):
        """This rank's El experts; forward takes rows sorted by global expert and their
        counts [E], and returns their outputs in the same order (dispatch, compute, combine)."""

        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.empty(El, a.hidden, a.dim).normal_(0, 0.02))
            self.w2 = nn.Parameter(torch.empty(El, a.dim, a.hidden).normal_(0, 0.02))
            self.w3 = nn.Parameter(torch.empty(El, a.hidden, a.dim).normal_(0, 0.02))

        def forward(self, rows, counts):
            t0 = time.perf_counter()
            counts_recv = torch.empty_like(counts)
            dist.all_to_all_single(counts_recv, counts, group=ep_group)
            in_splits = counts.view(a.ep, El).sum(1).tolist()
            out_splits = counts_recv.view(a.ep, El).sum(1).tolist()
            waited[0] += time.perf_counter() - t0
            recv = all_to_all_single_autograd(rows, out_splits, in_splits, ep_group)
            # received: by source rank, then local expert -> expert-major (stable)
            c = counts_recv.view(a.ep, El).flatten()
            seg = torch.repeat_interleave(torch.arange(a.ep * El), c)
            perm = torch.argsort((seg % El) * a.ep + seg // El, stable=True)
            x = recv.index_select(0, perm)
            local = counts_recv.view(a.ep, El).sum(0)
            h = F.silu(grouped_mm(x, self.w1, local)) * grouped_mm(x, self.w3, local)
            y = grouped_mm(h, self.w2, local)
            y = y.index_select(0, torch.argsort(perm))
            return all_to_all_single_autograd(y, in_splits, out_splits, ep_group)

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(a.dim, E, bias=False)
            nn.init.trunc_normal_(self.gate.weight, std=0.02)
            self.experts = Experts()
            self.shared = FeedForward(a.dim, a.hidden)

        def forward(self, x):
            rows = x.reshape(-1, a.dim)
            scores = torch.softmax(F.linear(rows.float(), self.gate.weight.float()), -1)
            chosen = torch.topk(scores.detach(), K, -1).indices
            top = scores.gather(-1, chosen)
            top = top / (top.sum(-1, keepdim=True) + 1e-20)
            counts = torch.bincount(chosen.flatten(), minlength=E)
            shared = self.shared(rows)
            order = torch.sort(chosen.flatten(), stable=True).indices
            token = order // K
            routed = self.experts(rows.index_select(0, token), counts)
            weighted = (routed.float() * top.flatten().index_select(0, order).unsqueeze(1)).to(rows.dtype)
            out = torch.zeros_like(rows).index_add(0, token, weighted) + shared
            return out.view(x.shape)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(a.dim)
            self.moe = MoE()

        def forward(self, x):
            return x + self.moe(self.norm(x))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(a.layers)])
    for block in model:
        experts = fully_shard(block.moe.experts, mesh=sparse["efsdp"])
        if world // a.ep == 1:  # on Gloo, another factor needs PREMUL_SUM, which Gloo lacks
            experts.set_gradient_divide_factor(float(world))
        fully_shard(block, mesh=dense)
    fully_shard(model, mesh=dense)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    x = torch.randn(a.tokens, a.dim)
    g = torch.randn(a.tokens, a.dim)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(x)
        ((out * g).sum() / a.tokens).backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    reset_live, live_peak = live_bytes("live_bytes_reset_peak"), live_bytes("live_bytes_peak")
    if reset_live:
        reset_live()
    waited[0] = 0.0
    ms = []
    profiler = None
    if a.products:  # the products' own time: self CPU time of the matrix-product kernels
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    products_ms, aten_ms = -1.0, -1.0
    if profiler is not None:
        profiler.__exit__(None, None, None)
        events = profiler.key_averages()
        products_ms = sum(e.self_cpu_time_total for e in events
                          if e.key in PRODUCTS) / 1e3 / a.steps
        aten_ms = sum(e.self_cpu_time_total for e in events
                      if e.key.startswith("aten::")) / 1e3 / a.steps
    figures = torch.tensor([live_peak() / 1e6 if live_peak else -1.0,
                            waited[0] * 1e6 / (a.steps * a.layers), products_ms, aten_ms],
                           dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({"ms": statistics.median(ms), "step_ms": ms,
                                      "live_peak_mb": float(figures[0]),
                                      "wait_us": float(figures[1]),
                                      "products_ms": float(figures[2]),
                                      "aten_ms": float(figures[3])}), flush=True)
    dist.destroy_process_group()


def run(cmd, preload=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    if preload:
        env["LD_PRELOAD"] = os.path.abspath(preload)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if preload and "LIVE_BYTES_HISTOGRAM" in os.environ:  # bench/live_bytes.cpp's, per rank
        print(f"{os.path.basename(cmd[-1]) if cmd else ''}", file=sys.stderr)
        for line in out.stderr.splitlines():
            if line.startswith("live_bytes at peak"):
                print(line, file=sys.stderr)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def fmt(xs, digits=1):
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def layouts(a, cols):
    """The table's head, then per layout ("ranks:ep"): ranks, ep, PyTorch's command, dtensor's."""
    model = ["--dim", str(a.dim), "--hidden", str(a.hidden), "--experts", str(a.experts),
             "--top-k", str(a.top_k), "--layers", str(a.layers), "--tokens", str(a.tokens),
             "--steps", str(a.steps), "--warmup", str(a.warmup)]
    print(f"dim {a.dim}, hidden {a.hidden}, {a.experts} experts, top {a.top_k}, "
          f"{a.layers} layers, {a.tokens} tokens per rank, {a.rounds} rounds\n")
    print("| " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * (len(cols) - 1))
    for layout in a.layouts:
        ranks, ep = (int(v) for v in layout.split(":"))
        tr = [a.torchrun, "--standalone", "--nproc-per-node", str(ranks)]
        yield (ranks, ep, tr + [__file__, "--worker", "--ep", str(ep)] + model,
               tr + ["--no-python", a.binary, "--ep", str(ep)] + model)


def driver(a):
    live = ["PyTorch live peak MB", "dtensor live peak MB"] if a.live_bytes else []
    cols = ["ranks", "ep", "efsdp", "PyTorch ms", "dtensor ms", "dtensor / PyTorch",
            "dtensor ms, no early exchange", *live, "PyTorch wait us", "dtensor wait us",
            "dtensor wait us, no early exchange", "all-to-alls per step"]
    for ranks, ep, theirs, mine in layouts(a, cols):
        t, d, late = [], [], []
        for _ in range(a.rounds):
            t.append(run(theirs))
            d.append(run(mine))
            late.append(run(mine + ["--no-early-exchange"]))
        mem = ""
        if a.live_bytes:
            mem = (f"| {run(theirs, a.live_bytes)['live_peak_mb']:.2f} "
                   f"| {run(mine, a.live_bytes)['live_peak_mb']:.2f} ")
        ratio = statistics.median(x["ms"] / y["ms"] for x, y in zip(d, t))
        print(f"| {ranks} | {ep} | {ranks // ep} | {fmt([r['ms'] for r in t])} "
              f"| {fmt([r['ms'] for r in d])} | {ratio:.2f}x | {fmt([r['ms'] for r in late])} {mem}"
              f"| {fmt([r['wait_us'] for r in t], 0)} | {fmt([r['wait_us'] for r in d], 0)} "
              f"| {fmt([r['wait_us'] for r in late], 0)} | {d[0]['all_to_alls']} |", flush=True)


def dispatch_driver(a):
    """--dispatch: dtensor's ways of moving the rows, alternating in one run: variable (the
    counts read by the host, early exchange), capacity (factor 1.25, no host read), capacity
    in two overlapped chunks, capacity with float8 rows; PyTorch's step as the yardstick. Forward all-to-all kB per layer
    (rank 0: counts, dispatch, combine)."""
    variants = [("variable", []), ("capacity 1.25", ["--capacity-factor", "1.25"]),
                ("capacity 1.25, overlapped", ["--capacity-factor", "1.25", "--overlap"]),
                ("capacity 1.25, float8", ["--capacity-factor", "1.25", "--float8-dispatch"])]
    cols = ["ranks", "ep", "PyTorch ms"] + [f"{n} ms" for n, _ in variants] + \
        [f"{n} / PyTorch" for n, _ in variants] + [f"{n} kB / layer" for n, _ in variants]
    for ranks, ep, theirs, mine in layouts(a, cols):
        t, d = [], [[] for _ in variants]
        for _ in range(a.rounds):
            t.append(run(theirs))
            for i, (_, extra) in enumerate(variants):
                d[i].append(run(mine + extra))
        ratios = [f"{statistics.median(x['ms'] / y['ms'] for x, y in zip(v, t)):.2f}x" for v in d]
        kb = [f"{v[0]['forward_a2a_kb_per_layer']:.1f}" for v in d]
        print(f"| {ranks} | {ep} | {fmt([r['ms'] for r in t])} | "
              + " | ".join(fmt([r['ms'] for r in v]) for v in d) + " | "
              + " | ".join(ratios) + " | " + " | ".join(kb) + " |", flush=True)


def products_driver(a):
    """--products: how much of PyTorch's step its kernels take, from a separate profiled run
    (self CPU time, the largest rank's): the matrix products, and every aten op (the products,
    the elementwise kernels, the copies, each with its own dispatch), beside both sides'
    unprofiled steps. Both sides run the same kernels on the same shapes (the same model, the
    same rows per rank, the same aten kernels), so each figure over PyTorch's step bounds the
    dtensor / PyTorch ratio that a runtime can reach with no overhead and no communication."""
    cols = ["ranks", "ep", "PyTorch ms", "dtensor ms", "dtensor / PyTorch",
            "PyTorch products ms", "products / PyTorch step", "PyTorch aten ops ms",
            "aten ops / PyTorch step"]
    for ranks, ep, theirs, mine in layouts(a, cols):
        t, d, prof = [], [], []
        for _ in range(a.rounds):
            t.append(run(theirs))
            d.append(run(mine))
            prof.append(run(theirs + ["--products"]))
        ratio = statistics.median(x["ms"] / y["ms"] for x, y in zip(d, t))
        share = {k: statistics.median(p[k] / y["ms"] for p, y in zip(prof, t))
                 for k in ("products_ms", "aten_ms")}
        print(f"| {ranks} | {ep} | {fmt([r['ms'] for r in t])} | {fmt([r['ms'] for r in d])} "
              f"| {ratio:.2f}x | {fmt([r['products_ms'] for r in prof])} "
              f"| {share['products_ms']:.2f} | {fmt([r['aten_ms'] for r in prof])} "
              f"| {share['aten_ms']:.2f} |", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("torchrun", nargs="?")
    p.add_argument("binary", nargs="?")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=["2:2", "4:4", "4:2"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--live-bytes", default=None)
    p.add_argument("--dispatch", action="store_true",
                   help="compare dtensor's dispatches (variable, capacity, overlapped, float8)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--products", action="store_true",
                   help="how much of PyTorch's step its matrix products take")
    a = p.parse_args()
    if a.worker:
        worker(a)
    elif a.dispatch:
        dispatch_driver(a)
    elif a.products:
        products_driver(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
