"""Step time and peak memory of FSDP training with activation checkpointing none / full /
selective: dtensor side by side with PyTorch FSDP2 + checkpoint_wrapper on the same CPU
ranks, alternating in one run.

Driver:  python bench/activation_checkpoint.py TORCHRUN BENCH_BIN [--rounds R] [--ranks 2 4]
                 [--dim D] [--layers L] [--seq S] [--batch B] [--steps N] [--warmup N]
Worker:  torchrun ... bench/activation_checkpoint.py --worker --ac MODE ... (PyTorch side)

The model and step are those of bench/activation_checkpoint.cpp: PyTorch's test Transformer
(dropout 0.1), each block wrapped with checkpoint_wrapper (full: recompute everything;
selective: torchtitan's "op" policy, matmuls and attention saved) and then fully_shard,
fully_shard on the root, AdamW + clip_grad_norm_. Time: median of a run's timed steps;
tables give the median over rounds and the spread (min-max). Memory: the peak of bytes
allocated on the CPU (net of frees) during one more step beyond what lived at its start
(the previous step's gradients, freed by zero_grad, count as freed). PyTorch side:
the profiler's memory events (torch.profiler, profile_memory=True: "Total Allocated" of the
CPU allocator's reports); dtensor side: a counting allocator wrapping LibTorch's.
Floor: the dtensor binary with --floor (no fully_shard, forward and backward alone: the work
every FSDP step does on these kernels, [Note: the compute floor] in the .cpp); floor /
PyTorch is the lowest ratio any FSDP implementation could reach on the same machine.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SAVED_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu")


def peak_of_step(step):
    """Peak CPU bytes allocated during step(1) beyond what lived at its start. The profiler
    sees a free only of a block allocated while it ran, so it runs over step(0) too and
    the window is step(1)'s (its frees of step(0)'s gradients and activations count)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(0)
        with record_function("measured_step"):
            step(1)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))["traceEvents"]
    begin = min(e["ts"] for e in trace if e.get("name") == "measured_step")
    cpu = sorted((e for e in trace if e.get("name") == "[memory]"
                  and e["args"].get("Device Type") == 0), key=lambda e: e["ts"])
    before = [e["args"]["Total Allocated"] for e in cpu if e["ts"] < begin]
    during = [e["args"]["Total Allocated"] for e in cpu if e["ts"] >= begin]
    if not before or not during:
        return -1
    return max(during) - before[-1]


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        ModelArgs,
        Transformer,
    )
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    vocab = 256
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=vocab, max_seq_len=args.seq, dim=args.dim,
                                  n_layers=args.layers, n_heads=4, dropout_p=0.1))
    saved = {getattr(torch.ops.aten, n).default for n in SAVED_OPS}

    def policy(ctx, op, *a, **k):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    for i, layer in enumerate(model.layers):
        if args.ac == "full":
            layer = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        elif args.ac == "selective":
            layer = checkpoint_wrapper(
                layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                context_fn=lambda: create_selective_checkpoint_contexts(policy))
        model.layers[i] = layer
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i):
        opt.zero_grad()
        torch.manual_seed(100 + i + 7 * rank)
        tokens = torch.randint(vocab, (args.batch, args.seq))
        targets = torch.randint(vocab, (args.batch, args.seq))
        nn.functional.cross_entropy(model(tokens).view(-1, vocab), targets.view(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for i in range(args.warmup):
        step(i)
    ms = []
    for i in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(args.warmup + i)
        ms.append((time.perf_counter() - t0) * 1e3)
    dist.barrier()
    peak = peak_of_step(lambda k: step(args.warmup + args.steps + k))
    if rank == 0:
        print("RESULT " + json.dumps({"step_ms": ms, "peak_bytes": peak}), flush=True)
    dist.destroy_process_group()


def run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            return statistics.median(r["step_ms"]), r["peak_bytes"]
    sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")


def fmt(xs):
    return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"


def mib(xs):
    return f"{statistics.median(xs) / 2**20:.1f}"


def driver(args):
    common = ["--dim", str(args.dim), "--layers", str(args.layers), "--seq", str(args.seq),
              "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
              str(args.warmup)]
    print(f"Transformer dim {args.dim}, {args.layers} blocks, 4 heads, seq {args.seq}, "
          f"batch {args.batch} per rank, vocab 256; {args.rounds} rounds\n")
    print("| ranks | AC | PyTorch FSDP2 ms | dtensor ms | dtensor / PyTorch | PyTorch peak MiB "
          "| dtensor peak MiB | dtensor / PyTorch peak | overlap off: dtensor / PyTorch "
          "| overlap off: peak / PyTorch | floor ms | floor / PyTorch |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ranks in args.ranks:
        tr = [args.torchrun, "--standalone", "--nproc-per-node", str(ranks)]
        for ac in ("none", "full", "selective"):
            t, d, o, fl, tm, dm, om, fm = [], [], [], [], [], [], [], []
            for _ in range(args.rounds):
                for times, mems, cmd in (
                        (t, tm, [__file__, "--worker"]),
                        (d, dm, ["--no-python", args.binary]),
                        (o, om, ["--no-python", args.binary, "--overlap", "off"]),
                        (fl, fm, ["--no-python", args.binary, "--floor"])):
                    ms, mem = run(tr + cmd + ["--ac", ac] + common)
                    times.append(ms)
                    mems.append(mem)
            ratio = statistics.median([x / y for x, y in zip(d, t)])
            off_ratio = statistics.median([x / y for x, y in zip(o, t)])
            floor_ratio = statistics.median([x / y for x, y in zip(fl, t)])
            mem_ratio = statistics.median(dm) / statistics.median(tm)
            off_mem_ratio = statistics.median(om) / statistics.median(tm)
            print(f"| {ranks} | {ac} | {fmt(t)} | {fmt(d)} | {ratio:.2f}x | {mib(tm)} | {mib(dm)} "
                  f"| {mem_ratio:.2f}x | {off_ratio:.2f}x | {off_mem_ratio:.2f}x | {fmt(fl)} "
                  f"| {floor_ratio:.2f}x |", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--ac", default="none", choices=["none", "full", "selective"])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    p.add_argument("torchrun", nargs="?")
    p.add_argument("binary", nargs="?")
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
