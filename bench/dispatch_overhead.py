"""Per-op dispatch overhead, dtensor against PyTorch's DTensor in the same run.

The measure of bench/dispatch_overhead.cpp (add of two Float[8k, 8] Shard(0) DTensors on k
ranks, minus the plain add of their local tensors, best of 5 x 20,000 ops on a sharding-cache
hit), taken for PyTorch's DTensor by this file's --worker, and for dtensor by the C++ program.
The driver alternates the two, several rounds per world size, and prints medians, spreads and
the ratio.

  python bench/dispatch_overhead.py TORCHRUN BENCH_BINARY [--rounds 5] [--ranks 1 2]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time


def worker():
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    k = dist.get_world_size()
    mesh = init_device_mesh("cpu", (k,), mesh_dim_names=("x",))
    x = torch.randn(8 * k, 8)
    a = distribute_tensor(x, mesh, [Shard(0)])
    b = distribute_tensor(x, mesh, [Shard(0)])
    la, lb = a.to_local(), b.to_local()

    def best_us(f, reps=5, iters=20000):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                f()
            best = min(best, (time.perf_counter() - t0) / iters * 1e6)
        return best

    plain = best_us(lambda: la + lb)
    hit = best_us(lambda: a + b)
    if dist.get_rank() == 0:
        print(f"| plain add of the local tensors | {plain:.2f} |")
        print(f"| DTensor add, cache hit | {hit:.2f} |")
        print(f"| **overhead on a hit** (hit - plain) | **{hit - plain:.2f}** |")
    dist.destroy_process_group()


def parse(out):
    m = re.search(r"overhead on a hit\*\* \(hit - plain\) \| \*\*([0-9.]+)\*\*", out)
    h = re.search(r"DTensor add, cache hit \| ([0-9.]+)", out)
    if not m or not h:
        raise RuntimeError("no figures in:\n" + out)
    return float(m.group(1)), float(h.group(1))


def run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="WARNING")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return parse(r.stdout)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("torchrun")
    ap.add_argument("binary")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    import torch
    print(f"PyTorch {torch.__version__}; {args.rounds} rounds, alternating; us per op: "
          "median (min - max)\n")
    print("| ranks | dtensor overhead | PyTorch overhead | PyTorch / dtensor | dtensor add (hit) | PyTorch add |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for k in args.ranks:
        launch = [args.torchrun, "--standalone", f"--nproc-per-node={k}"]
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(run(launch + ["--no-python", args.binary]))
            theirs.append(run(launch + [os.path.abspath(__file__), "--worker"]))

        def fmt(vals):
            return f"{statistics.median(vals):.2f} ({min(vals):.2f} - {max(vals):.2f})"

        o, t = [v[0] for v in ours], [v[0] for v in theirs]
        ratio = statistics.median(t) / statistics.median(o)
        print(f"| {k} | {fmt(o)} | {fmt(t)} | {ratio:.1f}x | {fmt([v[1] for v in ours])} | "
              f"{fmt([v[1] for v in theirs])} |")


if __name__ == "__main__":
    main()
