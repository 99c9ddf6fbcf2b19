"""Step time, memory and bubble of a pipeline schedule: dtensor (bench/pipeline.cpp) side by
side with PyTorch's torch.distributed.pipelining on the same CPU ranks, alternating in one
run.

Driver:  python bench/pipeline.py TORCHRUN BENCH_BIN [--rounds R] [--ranks 2 4]
                 [--schedules 1F1B Interleaved1F1B ZBVZeroBubble DualPipeV] [--microbatches M]
                 [--dim D] [--layers L] [--batch B] [--steps N] [--warmup N]
Worker:  torchrun ... bench/pipeline.py --worker --schedule NAME ... (PyTorch's side)

The model, input and loss are bench/pipeline.cpp's: `layers` blocks Linear(d, 4d)-GELU-
Linear(4d, d) split evenly into stages (one per rank; two for the multi-stage schedules),
input [batch, 64, d], loss sum((out - target)^2) / batch (PyTorch: scale_grads=False),
gradients zeroed before each step, no optimizer. Each round runs every configuration:
PyTorch, then dtensor. A run's figure is the median of its timed steps; the table gives
the median over rounds with the spread (min-max); ratios are medians of per-round ratios.
Memory: the growth of the resident set from the end of the warm-up steps to its peak over
the timed steps (the largest over ranks; VmHWM reset through /proc/self/clear_refs); with
--live-bytes LIB (build/bench/liblive_bytes.so), one more run of each side per
configuration with LIB preloaded gives the peak of live tensor bytes over the timed steps
(the largest over ranks): every tensor's memory, counted where LibTorch allocates it on
both sides (bench/live_bytes.cpp), blind to what glibc keeps after a free. Bubble (dtensor
only): measured, 1 - busy / (ranks x step), and as the timed simulation predicts it from
the measured mean cost of each action type, without and with the measured point-to-point
latency of one activation.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_util import live_bytes  # bench/bench_util.py (this script's folder)

CLASSES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B",
           "Interleaved1F1B": "ScheduleInterleaved1F1B", "LoopedBFS": "ScheduleLoopedBFS",
           "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
           "ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}
SINGLE = ("GPipe", "1F1B")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def reset_peak_rss_mb():
    """A new peak of the resident set from now ("5" to /proc/self/clear_refs resets VmHWM;
    the lifetime peak would measure start-up); the resident set now, MB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_mb()


def peak_rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e3
    return 0.0


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = 1 if args.schedule in SINGLE else 2
    num_stages = world * per_rank
    per_stage = args.layers // num_stages
    if per_rank == 1:
        mine = [rank]
    elif args.schedule in V_SHAPED:
        mine = [rank, 2 * world - 1 - rank]
    else:
        mine = [rank + k * world for k in range(per_rank)]
    torch.manual_seed(0)
    d = args.dim
    blocks = [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
              for _ in range(args.layers)]
    stages = [PipelineStage(nn.Sequential(*blocks[s * per_stage:(s + 1) * per_stage]), s,
                            num_stages, torch.device("cpu")) for s in mine]
    batch = args.batch

    def loss_fn(y, t):
        return (y - t).pow(2).sum() / batch

    cls = getattr(pipelining, CLASSES[args.schedule])
    sched = cls(stages[0] if per_rank == 1 else stages, args.microbatches, loss_fn=loss_fn,
                scale_grads=False)
    torch.manual_seed(1)
    x = torch.randn(batch, 64, d)
    target = torch.randn(batch, 64, d)

    def step():
        for st in stages:
            for p in st.submod.parameters():
                p.grad = None
        a = (x,) if 0 in mine else ()
        t = target if num_stages - 1 in mine else None
        sched.step(*a, target=t)

    for _ in range(args.warmup):
        step()
    reset_live, live_peak = live_bytes("live_bytes_reset_peak"), live_bytes("live_bytes_peak")
    if reset_live:
        reset_live()
    live_before = live_bytes("live_bytes_now")() / 1e6 if reset_live else -1.0
    before = reset_peak_rss_mb()  # after the warm-up's one-time costs
    ms = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    growth = torch.tensor([peak_rss_mb() - before, live_peak() / 1e6 if live_peak else -1.0,
                           live_before], dtype=torch.float64)
    if os.environ.get("BENCH_PIPELINE_VERBOSE"):  # each rank's own figures
        print(f"rank {rank}: live {live_before:.2f} MB before the timed steps, peak "
              f"{float(growth[1]):.2f} MB", file=sys.stderr, flush=True)
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({"step_ms": ms, "rss_growth_mb": float(growth[0]),
                                      "live_peak_mb": float(growth[1]),
                                      "live_before_mb": float(growth[2])}), flush=True)
    dist.destroy_process_group()


def run(cmd, preload=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["ms"] = statistics.median(r["step_ms"])
            if "bubble" in r:
                r["measured"] = statistics.median(r["bubble"])
            return r
    sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")


def fmt(xs, digits=1):
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def ratio(a, b):
    return statistics.median([x / y for x, y in zip(a, b)])


def driver(args):
    live = ["PyTorch live peak MB", "dtensor live peak MB"] if args.live_bytes else []
    cols = ["schedule", "ranks", "m", "PyTorch ms", "dtensor ms", "dtensor / PyTorch",
            "PyTorch RSS growth MB", "dtensor RSS growth MB", *live, "bubble measured",
            "bubble simulated", "with p2p latency", "per-stage costs", "replay of each step",
            "predicted / measured step",
            "p2p ms"]
    print("| " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * (len(cols) - 1))
    for ranks in args.ranks:
        for schedule in args.schedules:
            m = args.microbatches or 2 * ranks
            common = ["--schedule", schedule, "--microbatches", str(m), "--dim", str(args.dim),
                      "--layers", str(args.layers), "--batch", str(args.batch),
                      "--steps", str(args.steps), "--warmup", str(args.warmup)]
            tr = [args.torchrun, "--standalone", "--nproc-per-node", str(ranks)]
            t, d = [], []
            for _ in range(args.rounds):
                t.append(run(tr + [__file__, "--worker"] + common))
                d.append(run(tr + ["--no-python", args.binary] + common))
            mem = ""
            if args.live_bytes:  # one more pair, preloaded (the counter slows every free)
                lt = run(tr + [__file__, "--worker"] + common, args.live_bytes)
                ld = run(tr + ["--no-python", args.binary] + common, args.live_bytes)
                mem = f"| {lt['live_peak_mb']:.2f} | {ld['live_peak_mb']:.2f} "
                print(f"live at the first timed step: PyTorch {lt['live_before_mb']:.2f} MB, "
                      f"dtensor {ld['live_before_mb']:.2f} MB", file=sys.stderr)
            print(f"| {schedule} | {ranks} | {m} | {fmt([r['ms'] for r in t])} "
                  f"| {fmt([r['ms'] for r in d])} "
                  f"| {ratio([r['ms'] for r in d], [r['ms'] for r in t]):.2f}x "
                  f"| {fmt([r['rss_growth_mb'] for r in t])} "
                  f"| {fmt([r['rss_growth_mb'] for r in d])} {mem}"
                  f"| {fmt([r['measured'] for r in d], 3)} "
                  f"| {fmt([r['simulated_bubble'] for r in d], 3)} "
                  f"| {fmt([r['simulated_bubble_p2p'] for r in d], 3)} "
                  f"| {fmt([r['simulated_bubble_stage'] for r in d], 3)} "
                  f"| {fmt([statistics.median(r['replay_bubbles']) for r in d], 3)} "
                  f"| {ratio([r['staged_makespan_ms'] for r in d], [r['ms'] for r in d]):.2f} "
                  f"| {fmt([r['p2p_ms'] for r in d], 2)} |", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--schedules", nargs="*",
                   default=["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
    p.add_argument("--microbatches", type=int, default=0)  # 0: 2 x ranks
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    p.add_argument("--live-bytes", default=None)  # build/bench/liblive_bytes.so
    p.add_argument("torchrun", nargs="?")
    p.add_argument("binary", nargs="?")
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
