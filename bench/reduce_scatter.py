"""One reduce-scatter and one all-gather over Gloo, dtensor against PyTorch's
dist.reduce_scatter_tensor and dist.all_gather_into_tensor; and DTensor.from_local without a
shape (dtensor agrees the shape over the mesh: [Note: agreeing on sizes]).

The measure of bench/reduce_scatter.cpp (median ms of 20 synchronous sum reduce-scatters of
a float tensor of 4,096, 786,432 and 3,145,728 elements, and of 20 all-gathers into tensors of those
sizes, each after a barrier, one thread per rank),
taken for PyTorch by this file's --worker and for dtensor by the C++ program. The driver
alternates the two, several rounds per world size, and prints a Markdown table: medians over
rounds (spread in parentheses) and the median of the per-round ratios.

  python bench/reduce_scatter.py TORCHRUN BENCH_BINARY [--rounds 5] [--ranks 2 4]
"""
import argparse
import json
import os
import statistics
import sys
import time

from bench_util import torchrun_result  # bench/bench_util.py (this script's folder)


def worker():
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    result = {}
    for kind in ("rs", "ag"):
        for numel in (4096, 786432, 3145728):
            whole = torch.randn(numel) if kind == "rs" else torch.empty(numel)
            shard = torch.empty(numel // world) if kind == "rs" else torch.randn(numel // world)
            ms = []
            for i in range(23):
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "rs":
                    dist.reduce_scatter_tensor(shard, whole)
                else:
                    dist.all_gather_into_tensor(whole, shard)
                t1 = time.perf_counter()
                if i >= 3:
                    ms.append((t1 - t0) * 1e3)
            result[f"{kind}:{numel}"] = statistics.median(ms)
    # DTensor.from_local of a 2x2 tensor as Shard(0), no shape: PyTorch takes it on trust
    # (run_check=False, its default), dtensor agrees the shape over the mesh first.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (world,))
    local = torch.ones(2, 2)
    ms = []
    for i in range(23):
        dist.barrier()
        t0 = time.perf_counter()
        DTensor.from_local(local, mesh, [Shard(0)])
        t1 = time.perf_counter()
        if i >= 3:
            ms.append((t1 - t0) * 1e3)
    result["fl:4"] = statistics.median(ms)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("torchrun")
    ap.add_argument("binary")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print("| collective | ranks | MiB | PyTorch ms | dtensor ms | dtensor / PyTorch |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for world in args.ranks:
        torch_ms, ours_ms = {}, {}
        for _ in range(args.rounds):
            t = torchrun_result(args.torchrun, world, [os.path.abspath(__file__), "--worker"])
            d = torchrun_result(args.torchrun, world, ["--no-python", os.path.abspath(args.binary)])
            for k in t:
                torch_ms.setdefault(k, []).append(t[k])
                ours_ms.setdefault(k, []).append(d[k])
        for k in torch_ms:
            a, b = torch_ms[k], ours_ms[k]
            ratio = statistics.median(y / x for x, y in zip(a, b))
            kind, numel = k.split(":")
            name = {"rs": "reduce-scatter", "ag": "all-gather", "fl": "from_local, no shape"}[kind]
            print(f"| {name} | {world} | {int(numel) * 4 / 2**20:.3g} | {statistics.median(a):.3f} "
                  f"({min(a):.3f}-{max(a):.3f}) | {statistics.median(b):.3f} "
                  f"({min(b):.3f}-{max(b):.3f}) | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
