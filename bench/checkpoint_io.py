#!/usr/bin/env python3
"""Checkpoint save / load throughput: dtensor vs PyTorch DCP, alternately, same ranks, same state.

usage: checkpoint_io.py TORCHRUN BENCH_BINARY [--mb 256] [--rounds 5] [--ranks 2 4] [--dir D]
Each round runs, in turn, dtensor (bench_checkpoint_io), dtensor without chunk hashes (what
PyTorch's readers and writers do: no integrity check), PyTorch dcp.save / dcp.load with
HuggingFaceStorageWriter(save_distributed=True) / HuggingFaceStorageReader (the same
safetensors layout), and PyTorch with its default FileSystemWriter / Reader (.distcp files),
each a fresh torchrun job saving then loading the same state (MB of float32 in [4096, 1024]
tensors sharded Shard(0), plus a replicated 1 MB tensor) into a fresh directory. Times are the
slowest rank's, from a barrier to the end of the call. Prints a markdown table: MB/s medians
(min - max over rounds) and the ratios to PyTorch.

As a torchrun worker (internal): checkpoint_io.py --worker hf|default DIR MB
"""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def worker(kind, out, mb):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state, target, nbytes = {}, {}, 0
    for i in range(max(1, mb // 16)):
        torch.manual_seed(i)
        state[f"layers.{i}.weight"] = distribute_tensor(torch.randn(4096, 1024), mesh, [Shard(0)])
        target[f"layers.{i}.weight"] = distribute_tensor(torch.zeros(4096, 1024), mesh, [Shard(0)])
        nbytes += 4096 * 1024 * 4
    state["norm.weight"] = torch.ones(512, 512)
    target["norm.weight"] = torch.zeros(512, 512)
    nbytes += 512 * 512 * 4
    if kind == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
        writer = HuggingFaceStorageWriter(out, save_distributed=True)
        reader = HuggingFaceStorageReader(out)
    else:
        writer = dcp.FileSystemWriter(out)
        reader = dcp.FileSystemReader(out)

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    save_s = timed(lambda: dcp.save(state, storage_writer=writer))
    load_s = timed(lambda: dcp.load(target, storage_reader=reader))
    for k, v in state.items():
        got = target[k]
        if not torch.equal(getattr(v, "_local_tensor", v), getattr(got, "_local_tensor", got)):
            raise SystemExit(f"{k} differs after load")
    if dist.get_rank() == 0:
        print(f"{save_s:.6f} {load_s:.6f} {nbytes}")
    dist.destroy_process_group()


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
    save_s, load_s, nbytes = p.stdout.strip().splitlines()[-1].split()
    return float(save_s), float(load_s), int(nbytes)


def main():
    if sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    torchrun, binary = sys.argv[1], sys.argv[2]
    args = sys.argv[3:]
    mb = int(args[args.index("--mb") + 1]) if "--mb" in args else 256
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 5
    ranks = [2, 4]
    if "--ranks" in args:
        i = args.index("--ranks") + 1
        ranks = []
        while i < len(args) and args[i].isdigit():
            ranks.append(int(args[i]))
            i += 1
    base = args[args.index("--dir") + 1] if "--dir" in args else tempfile.gettempdir()
    me = os.path.abspath(__file__)
    print(f"| ranks | system | save MB/s: median (min - max) | load MB/s: median (min - max) |")
    print("| ---: | --- | ---: | ---: |")
    for n in ranks:
        results = {"dtensor": [], "dtensor, no hashes": [], "PyTorch DCP, HF safetensors": [],
                   "PyTorch DCP, default .distcp": []}
        for _ in range(rounds):
            for name in results:
                d = tempfile.mkdtemp(prefix="ckpt-bench-", dir=base)
                out = os.path.join(d, "ckpt")
                tr = [torchrun, "--standalone", f"--nproc-per-node={n}"]
                if name.startswith("dtensor"):
                    cmd = tr + ["--no-python", binary, out, str(mb)] + (["no-hash"] if "no" in name else [])
                else:
                    kind = "hf" if "HF" in name else "default"
                    cmd = tr + [me, "--worker", kind, out, str(mb)]
                results[name].append(run(cmd))
                shutil.rmtree(d, ignore_errors=True)
        rate = {}
        for name, rs in results.items():
            mbytes = rs[0][2] / 1e6
            saves = [mbytes / r[0] for r in rs]
            loads = [mbytes / r[1] for r in rs]
            rate[name] = (statistics.median(saves), statistics.median(loads))
            print(f"| {n} | {name} | {rate[name][0]:.0f} ({min(saves):.0f} - {max(saves):.0f}) | "
                  f"{rate[name][1]:.0f} ({min(loads):.0f} - {max(loads):.0f}) |")
        for mine in ("dtensor", "dtensor, no hashes"):
            for name in list(results)[2:]:
                print(f"| {n} | {mine} / {name} | {rate[mine][0] / rate[name][0]:.2f}x | "
                      f"{rate[mine][1] / rate[name][1]:.2f}x |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
