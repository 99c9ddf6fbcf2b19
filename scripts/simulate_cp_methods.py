#!/usr/bin/env python3
"""Context parallelism's four methods planned at 32k tokens on cp 16 (docs/context_parallel.md,
"Planned at scale"): `train --simulate 16 --cp 16` of llama2-7b's shape (MHA, 32 heads of
128, 32 layers, vocab 32,000), one sequence of 32,768 tokens a step, full AC, on two machines
of the time model:

- "H100 x 2 nodes": the defaults (8 per node: NVLink 360 GB/s, the network 45 GB/s).
- "torus pod": 16 chips in one interconnect domain, collectives at 400 GB/s, a send to one
  peer at 100 GB/s (one link), 240 TFLOP/s achieved: the published TPU v5p row's machine as
  far as the time model can say it (maxtext's Ulysses pull request, 2026-07: Ulysses 8.90 s,
  all-gather 8.83 s, ring 16.38 s).

Prints a Markdown table: per method, the bytes a rank sends over cp per layer in the forward
(the time model's wire bytes: an all-gather or all-to-all (k-1)/k of its size, a send all of
it) beside the method's formula, the predicted step, tokens/s per GPU and the ratio to Ulysses.

usage: simulate_cp_methods.py TRAIN [OUTDIR]
"""
import json
import os
import subprocess
import sys

S, H, D, LAYERS, CP, B = 32768, 32, 128, 32, 16, 2  # bf16
MODEL = ["--dim", "4096", "--layers", str(LAYERS), "--heads", str(H), "--kv-heads", str(H),
         "--vocab", "32000", "--seq", str(S), "--batch", "1", "--ac", "full"]
MACHINES = [("H100 x 2 nodes", []),
            ("torus pod", ["--node", "16", "--nvlink-gbps", "400", "--p2p-gbps", "100",
                           "--tflops", "240"])]
U = 8  # the hierarchical method's all-to-all degree: a node's ranks
METHODS = [("ulysses", []), ("allgather", []), ("ring", []),
           ("hierarchical", ["--cp-ulysses-degree", str(U)])]


def formula(method):
    """Bytes a rank sends over cp per layer in the forward (MHA: K/V heads = heads)."""
    tok = S // CP * D * B  # one head's local tokens
    if method == "ulysses":  # q, k, v in, the output back
        return (CP - 1) / CP * 4 * H * tok
    if method == "allgather":  # K and V gathered
        return (CP - 1) / CP * 2 * H * S * D * B
    if method == "ring":  # cp - 1 steps of this rank's K and V
        return (CP - 1) * 2 * H * tok
    r = CP // U  # hierarchical: the inner all-to-alls, then a ring of r over H / U heads
    return (U - 1) / U * 4 * H * tok + (r - 1) * 2 * (H // U) * (S // r) * D * B


def wire(c):
    k = len(c["ranks"])
    if c["kind"] == "all_gather":
        return (k - 1) / k * c["bytes_out"]
    if c["kind"] in ("all_to_all", "reduce_scatter"):
        return (k - 1) / k * c["bytes_in"]
    return c["bytes_in"] if c["kind"] == "send" else 0


def plan(train, out, machine, flags, method, extra):
    d = os.path.join(out, f"{machine.split()[0]}-{method}")
    args = [train, "--simulate", "16", "--mesh", "1x1x1", "--cp", str(CP), "--cp-method", method,
            "--out", d, *MODEL, *flags, *extra]
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{machine} {method}: {(p.stderr.strip() or p.stdout.strip()).splitlines()[-1]}")
    m = json.load(open(os.path.join(d, "simulation.json")))["meshes"][0]
    report = json.load(open(os.path.join(d, "1x1x1", "rank0.json")))
    forward = next(p for p in report["phases"] if p["name"] == "forward")
    sent = sum(wire(c) for c in forward["collectives"] if c["group"].startswith("cp"))
    return sent / LAYERS, m["time"]["step_s"], m["time"]["tokens_per_s_per_gpu"]


def main():
    train = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else "train-out/cp_methods"
    print("| machine | method | MiB sent per layer (forward) | formula | step s | tok/s/GPU |"
          " step / Ulysses |")
    print("|---|---|---|---|---|---|---|")
    for machine, flags in MACHINES:
        first = None
        for method, extra in METHODS:
            sent, step, tps = plan(train, out, machine, flags, method, extra)
            first = first or step
            print(f"| {machine} | {method} | {sent / 2**20:.1f} | {formula(method) / 2**20:.1f} |"
                  f" {step:.3f} | {tps:.0f} | {step / first:.2f} |", flush=True)


if __name__ == "__main__":
    main()
