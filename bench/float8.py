"""A training step of feed-forward blocks under FSDP with float8 linears: dtensor
(bench/float8.cpp) side by side with torchao's Float8Linear under PyTorch 2.15's FSDP2, on the
same CPU ranks, alternating in one run. On CPU float8 products are emulated (at::_scaled_mm
casts back to fp32), so the figures that carry over to GPUs are bytes: what the all-gathers
move and the live peak; step times show the emulation's cost, not float8's speed.

Driver:  python bench/float8.py TORCHRUN BENCH_BIN [--ranks 4] [--rounds 2]
                 [--live-bytes build/bench/liblive_bytes.so] [--variants V ...] [model flags]
Worker:  torchrun ... bench/float8.py --worker --variant V [model flags]   (PyTorch's side)

The model (both sides): --layers blocks x + FFN(RMSNorm(x)) (the RMSNorm computed in fp32 and
cast back, as dtensor's model computes it: tools/torch_llama3.py), SwiGLU w1 / w3 [hidden, dim],
w2 [dim, hidden], no biases, fp32 parameters; fully_shard of each block and the root over the
world with bf16 parameters and fp32 reduction. Variants: bf16 (no float8), tensorwise,
tensorwise with the float8 all-gather (scales precomputed after each optimizer step, torchao's
precompute_float8_dynamic_scale_for_fsdp), rowwise. A step: --tokens rows per rank, loss
sum(out * g) / rows, backward, AdamW. Per variant and round: PyTorch, then dtensor; the step
time is the median of the timed steps, the table the median over rounds (min-max). All-gather
bytes: what this rank hands to the all-gathers in one step (PyTorch's counted at
dist.all_gather_single); all-reduces: per step, the precompute's included (PyTorch's from
CommDebugMode). Live peak (with --live-bytes): one more run of each side, preloaded: the
largest rank's peak of live tensor bytes over the timed steps (bench/live_bytes.cpp), and a
third run of dtensor's side with fully_shard's communication overlap off (--overlap off: each
collective completes where it is issued, the schedule FSDP2 has on CPU, where there are no
streams).
"""
import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

from bench_util import live_bytes  # bench/bench_util.py (this script's folder)

VARIANTS = {"bf16": [], "tensorwise": ["--float8", "tensorwise"],
            "tensorwise + float8 all-gather": ["--float8", "tensorwise", "--float8-all-gather"],
            "rowwise": ["--float8", "rowwise"]}


def worker(a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [0]
    all_gather = dist.all_gather_single

    def counting_all_gather(output, input, *args, **kwargs):  # FSDP2's all-gathers
        gathered[0] += input.numel() * input.element_size()
        return all_gather(output, input, *args, **kwargs)

    dist.all_gather_single = counting_all_gather

    # The same RMSNorm as dtensor's model (computed in fp32, cast back: models/llama3/layers.h),
    # not nn.RMSNorm, which computes in the input's dtype and so saves bf16 activations where
    # this saves fp32 ones: the live peaks compare the same model.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    from torch_llama3 import RMSNorm  # noqa: PLC0415 (the recipe benchmark's layers)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(a.dim)
            self.w1 = nn.Linear(a.dim, a.hidden, bias=False)
            self.w2 = nn.Linear(a.hidden, a.dim, bias=False)
            self.w3 = nn.Linear(a.dim, a.hidden, bias=False)
            for w in (self.w1, self.w2, self.w3):
                nn.init.trunc_normal_(w.weight, std=0.02)

        def forward(self, x):
            h = self.norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(a.layers)])
    flags = VARIANTS[a.variant]
    fp8_gather = "--float8-all-gather" in flags
    if flags:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        config = Float8LinearConfig.from_recipe_name(flags[1])
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=fp8_gather)
        convert_to_float8_training(model, config=config)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    x, g = torch.randn(a.tokens, a.dim), torch.randn(a.tokens, a.dim)
    counts = [0]

    def step():
        gathered[0] = 0
        with CommDebugMode() as comm:
            opt.zero_grad(set_to_none=True)
            out = model(x)
            ((out.float() * g).sum() / a.tokens).backward()
            opt.step()
            if fp8_gather:
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
                precompute_float8_dynamic_scale_for_fsdp(model)
        counts[0] = sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op))

    for _ in range(a.warmup):
        step()
    reset_live, live_peak = live_bytes("live_bytes_reset_peak"), live_bytes("live_bytes_peak")
    if reset_live:
        reset_live()
    ms = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    peak = torch.tensor([live_peak() / 1e6 if live_peak else -1.0], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({"ms": statistics.median(ms), "step_ms": ms,
                                      "all_gather_bytes": gathered[0], "all_reduces": counts[0],
                                      "live_peak_mb": float(peak[0])}), flush=True)
    dist.destroy_process_group()


def run(cmd, preload=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
               PYTHONWARNINGS="ignore")
    if preload:
        env["LD_PRELOAD"] = os.path.abspath(preload)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def fmt(xs, digits=1):
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def driver(a):
    model = ["--dim", str(a.dim), "--hidden", str(a.hidden), "--layers", str(a.layers),
             "--tokens", str(a.tokens), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    live = (["PyTorch live peak MB", "dtensor live peak MB", "dtensor live peak MB, overlap off"]
            if a.live_bytes else [])
    cols = ["variant", "PyTorch ms", "dtensor ms", "dtensor / PyTorch",
            "PyTorch all-gather KB", "dtensor all-gather KB", "PyTorch all-reduces",
            "dtensor all-reduces", *live]
    print(f"{a.ranks} ranks, dim {a.dim}, hidden {a.hidden}, {a.layers} layers, {a.tokens} "
          f"tokens per rank, {a.rounds} rounds\n")
    print("| " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * (len(cols) - 1))
    tr = [a.torchrun, "--standalone", "--nproc-per-node", str(a.ranks)]
    for variant in a.variants:
        flags = VARIANTS[variant]
        theirs = tr + [__file__, "--worker", "--variant", variant] + model
        mine = tr + ["--no-python", a.binary] + flags + model
        t, d = [], []
        for _ in range(a.rounds):
            t.append(run(theirs))
            d.append(run(mine))
        mem = ""
        if a.live_bytes:
            mem = (f" {run(theirs, a.live_bytes)['live_peak_mb']:.2f} |"
                   f" {run(mine, a.live_bytes)['live_peak_mb']:.2f} |"
                   f" {run(mine + ['--overlap', 'off'], a.live_bytes)['live_peak_mb']:.2f} |")
        ratio = statistics.median(y["ms"] / x["ms"] for x, y in zip(t, d))
        print(f"| {variant} | {fmt([r['ms'] for r in t])} | {fmt([r['ms'] for r in d])} "
              f"| {ratio:.2f}x | {t[0]['all_gather_bytes'] / 1024:.1f} "
              f"| {d[0]['all_gather_bytes'] / 1024:.1f} | {t[0]['all_reduces']} "
              f"| {d[0]['all_reduces']} |{mem}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("torchrun", nargs="?")
    p.add_argument("binary", nargs="?")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--variant", default="bf16", choices=list(VARIANTS))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--live-bytes", default=None)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   metavar="V", help="which variants (default: all): " + ", ".join(VARIANTS))
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    if a.worker:
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
