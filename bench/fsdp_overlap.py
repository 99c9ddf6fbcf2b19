"""Step time of fully_shard + AdamW + clip_grad_norm_: dtensor (overlap on and off) side by
side with PyTorch FSDP2 on the same CPU ranks, alternating in one run.

Driver:  python bench/fsdp_overlap.py TORCHRUN BENCH_BIN [--rounds R] [--ranks 2 4]
                 [--dims 64 256 512] [--tp-dims 64 256] [--steps N] [--warmup N]
Worker:  torchrun ... bench/fsdp_overlap.py --worker --model mlp|tp --dim D ... (PyTorch side)

Models and steps are those of bench/fsdp_overlap.cpp (the dtensor side). Each round runs,
for every configuration, PyTorch, dtensor with overlap, dtensor without; for the MLP also
the limit: dtensor on 1 rank with the same per-rank batch (no communication). A run's
figure is the median of its timed steps; the table gives the median over rounds and the
spread (min-max) of the run figures. Ratios are medians of the per-round ratios.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.model == "mlp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        torch.manual_seed(0)
        d = args.dim
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(4)]
        )
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

        def loss(step):
            torch.manual_seed(100 + step + 7 * rank)
            return model(torch.randn(8, 32, d)).square().mean()

    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        from torch.testing._internal.distributed._tensor.common_dtensor import (
            ModelArgs,
            Transformer,
        )

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        vocab, seq = 64, 32
        torch.manual_seed(0)
        model = Transformer(
            ModelArgs(vocab_size=vocab, max_seq_len=seq, dim=args.dim, n_layers=2, n_heads=4,
                      dropout_p=0.0)
        )
        plan = {
            "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(),
        }
        parallelize_module(model, mesh["tp"], plan)
        for layer in model.layers:
            layer.attention.n_heads //= 2  # local heads: the projections return local outputs
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_rank = mesh.get_local_rank(0)

        def loss(step):
            torch.manual_seed(100 + step + 7 * dp_rank)
            tokens = torch.randint(vocab, (8, seq))
            targets = torch.randint(vocab, (8, seq))
            return nn.functional.cross_entropy(model(tokens).view(-1, vocab), targets.view(-1))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())

    def clip(max_norm):
        if args.model == "mlp":
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        # FSDP x TP: PyTorch's clip_grad_norm_ fails on gradients over different meshes
        # (stack of DTensors on (dp) and (dp, tp)); the usual workaround: one norm per mesh.
        by_mesh = {}
        for p in params:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
        norms = [torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs]))
                 .full_tensor() for gs in by_mesh.values()]
        total = torch.linalg.vector_norm(torch.stack(norms))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).item()
        for p in params:
            p.grad.mul_(coef)
        return total

    def step(i):
        opt.zero_grad()
        loss(i).backward()
        clip(1.0)
        opt.step()

    for i in range(args.warmup):
        step(i)
    ms = []
    for i in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(args.warmup + i)
        ms.append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        print("RESULT " + json.dumps({"step_ms": ms}), flush=True)
    dist.destroy_process_group()


def run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return statistics.median(json.loads(line[7:])["step_ms"])
    sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")


def fmt(xs):
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def ratio(a, b):
    return statistics.median([x / y for x, y in zip(a, b)])


def driver(args):
    torchrun, binary = args.torchrun, args.binary
    configs = [("mlp", r, d) for r in args.ranks for d in args.dims]
    configs += [("tp", 4, d) for d in args.tp_dims]
    print("| model | ranks | d | PyTorch FSDP2 ms | dtensor overlap on ms | dtensor overlap off ms "
          "| limit (1 rank) ms | on / PyTorch | on / off | on / limit | off / limit |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, ranks, d in configs:
        # Enough timed steps for short steps to settle (Gloo on 2 shared cores is noisy).
        steps = args.steps or max(10, 60 * 64 // d)
        common = ["--model", model, "--dim", str(d), "--steps", str(steps),
                  "--warmup", str(args.warmup)]
        tr = [torchrun, "--standalone", "--nproc-per-node"]
        t, on, off, lim = [], [], [], []
        for _ in range(args.rounds):
            t.append(run(tr + [str(ranks), __file__, "--worker"] + common))
            on.append(run(tr + [str(ranks), "--no-python", binary] + common + ["--overlap", "1"]))
            off.append(run(tr + [str(ranks), "--no-python", binary] + common + ["--overlap", "0"]))
            if model == "mlp":
                lim.append(run(tr + ["1", "--no-python", binary] + common + ["--overlap", "1"]))
        limit = [fmt(lim), f"{ratio(on, lim):.2f}x", f"{ratio(off, lim):.2f}x"] if lim else \
            ["-", "-", "-"]
        print(f"| {model} | {ranks} | {d} | {fmt(t)} | {fmt(on)} | {fmt(off)} | {limit[0]} "
              f"| {ratio(on, t):.2f}x | {ratio(on, off):.2f}x | {limit[1]} | {limit[2]} |",
              flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--model", default="mlp")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=0)  # 0: 60 * 64 / d, at least 10
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    p.add_argument("--dims", type=int, nargs="*", default=[64, 256, 512])
    p.add_argument("--tp-dims", type=int, nargs="*", default=[64, 256])
    p.add_argument("torchrun", nargs="?")
    p.add_argument("binary", nargs="?")
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
