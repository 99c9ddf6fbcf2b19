"""The cost of one pipeline hop on an oversubscribed CPU machine: a Gloo send / recv round trip
between two ranks of four, with the other two ranks idle or busy with matmuls (what the
pipelined rows of docs/benchmarks.md, "Llama 3 recipe", run on: 4 ranks sharing 2 cores).
Both dtensor's and PyTorch's schedules move activations and gradients this way (c10d's Gloo
send / recv), so the hop is a cost they share.

  python bench/p2p_latency.py TORCHRUN [--rounds 3]

Per run: 40 round trips of a [4, 64, 256] float tensor (the large config's microbatch of
hidden states), 20 matmuls of 256 x 256 between them on the two ranks; the median and the 90th
percentile. Prints a Markdown table: medians over the rounds.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(busy):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.randn(4, 64, 256)
    a = torch.randn(256, 256)
    rtts = []
    if rank in (0, 1):
        peer = 1 - rank
        for _ in range(40):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)
            rtts.append(time.perf_counter() - t0)
            for _ in range(20):
                a @ a
    elif busy:
        end = time.perf_counter() + 3.0
        while time.perf_counter() < end:
            a @ a
    dist.barrier()
    if rank == 0:
        rtts.sort()
        print(f"RESULT {rtts[len(rtts) // 2] * 1e3:.3f} {rtts[int(len(rtts) * 0.9)] * 1e3:.3f}")
    dist.destroy_process_group()


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2] == "busy")
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("torchrun")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    print("| other two ranks | round trip ms (median) | round trip ms (90th percentile) |")
    print("|---|---|---|")
    for mode in ("idle", "busy"):
        med, p90 = [], []
        for _ in range(args.rounds):
            p = subprocess.run([args.torchrun, "--standalone", "--nproc-per-node=4",
                                os.path.abspath(__file__), "--worker", mode],
                               capture_output=True, text=True, env=env, timeout=300)
            line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT"))
            med.append(float(line.split()[1]))
            p90.append(float(line.split()[2]))
        print(f"| {mode} | {statistics.median(med):.2f} ({min(med):.2f}-{max(med):.2f}) "
              f"| {statistics.median(p90):.2f} |", flush=True)


if __name__ == "__main__":
    main()
