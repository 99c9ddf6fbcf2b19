"""Context parallelism's cost on CPU ranks: the Llama 3 model's forward and backward over one
long sequence, as the plain model on one rank, on data-parallel ranks (each its own whole
sequence), and with cp 2 / 4 by each method (--methods: allgather, ring, ulysses,
hierarchical; bench/context_parallel.cpp, one row each). With --documents one packed row of
documents of mixed lengths under the document mask, each method with the documents-by-cost
layout and with head-tail, judged by the document mask on one rank.
PyTorch 2.15's context_parallel does not run on CPU (no sharding strategy for the CPU flash
kernel), so the judge of each row is the 1-rank plain model: CP must split its work, not
repeat it.

    python bench/context_parallel.py TORCHRUN build/bench/bench_context_parallel \\
        --seqs 1024 4096 16384 --rounds 2 [--steps 3 --warmup 1] \\
        [--live-bytes build/bench/liblive_bytes.so]

Each round runs every row once, in order; a row's figures are medians over the rounds.
Printed per sequence length, markdown:
- step ms: the slowest rank's median wall time of a step;
- CPU ms (sum): the CPU time of a step summed over the ranks (user + system, the
  collectives' threads included), and its ratio to the 1-rank row's per sequence (goal
  <= 1.3 for CP; dp ranks train one sequence each, so their sum is divided by the ranks);
- balance: the busiest rank's CPU time over the least busy one's (goal <= 1.10);
- bytes: each rank's bytes handed to collectives per step, against the method's formula
  (per layer, K_b = this rank's K and V bytes, Q_b its q's: all-gather K_b + cp K_b, ring
  3 (cp-1) K_b, Ulysses 2 (2 Q_b + K_b), hierarchical with groups of u 2 (2 Q_b + K_b) +
  3 (cp/u - 1) K_b);
- K/V peak: the most K/V bytes an attention call held at once (cp_stats), and the live
  peak of all tensor bytes over the timed steps (MB, the largest rank; with --live-bytes).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def run(torchrun, binary, nproc, args, env):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", binary] + args
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.exit(f"{' '.join(cmd)}: no RESULT line:\n{out.stdout[-2000:]}")


def needed_formula(result, cp, a):
    """The all-gather method under the causal document mask (batch 1): rank r receives the rows
    of rank s that some query of r may attend to (a key k is needed when r holds a query p >= k
    of k's document), and sends their gradients back; the most any rank hands over, in bytes.
    Counted from the documents and positions alone, not from the library's block plan."""
    doc = [i for i, n in enumerate(result["documents"]) for _ in range(n)]
    pos = result["positions"]
    top = []  # top[r][d]: the last position of document d among rank r's queries
    for r in range(cp):
        t = {}
        for p in pos[r]:
            t[doc[p]] = max(t.get(doc[p], -1), p)
        top.append(t)

    def need(r, s):
        return sum(1 for k in pos[s] if k <= top[r].get(doc[k], -1))

    row = 2 * a.kv_heads * (a.dim // a.heads) * 4  # a row of K and V, fp32
    per_rank = [sum(need(o, me) + need(me, o) for o in range(cp) if o != me) * row
                for me in range(cp)]
    return max(per_rank) * a.layers


def formula(method, cp, seq, a, result=None):
    """Bytes a rank hands to collectives per step by the method's formula (fp32, batch 1):
    K_b = this rank's K and V bytes, Q_b its q's (or the output's)."""
    if method not in ("allgather", "ring", "ulysses", "hierarchical") or cp == 1:
        return 0
    if method == "allgather" and result and result.get("documents"):
        return needed_formula(result, cp, a)
    head_rows = (seq // cp) * (a.dim // a.heads) * 4  # one head's rows on this rank, bytes
    kb, qb = 2 * a.kv_heads * head_rows, a.heads * head_rows
    ring = cp // a.ulysses_degree
    per_layer = {"allgather": kb + cp * kb, "ring": 3 * (cp - 1) * kb,
                 # forward and backward: one all-to-all of q, k, v and one of the output each
                 "ulysses": 2 * (qb + kb + qb),
                 # the same in groups, and the ring's 3 (ring - 1) exchanges of the group's
                 # K/V of 1/u of the heads (as many bytes as this rank's K/V)
                 "hierarchical": 2 * (qb + kb + qb) + 3 * (ring - 1) * kb}[method]
    return per_layer * a.layers


def main():
    p = argparse.ArgumentParser()
    p.add_argument("torchrun")
    p.add_argument("binary")
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--live-bytes", default=None)
    p.add_argument("--unbalanced", action="store_true",
                   help="also the ring without load balancing at the largest cp")
    p.add_argument("--methods", nargs="+", default=["allgather", "ring"],
                   help="cp methods: allgather ring ulysses hierarchical")
    p.add_argument("--ulysses-degree", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--documents", action="store_true",
                   help="packed documents of mixed lengths under the document mask, balanced "
                        "by cost and by head-tail; the 1-rank row the block engine's")
    a = p.parse_args()
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1")
    if a.live_bytes:
        env["LD_PRELOAD"] = os.path.abspath(a.live_bytes)
    model = ["--dim", str(a.dim), "--layers", str(a.layers), "--heads", str(a.heads),
             "--kv-heads", str(a.kv_heads)]
    if a.documents:  # the judge: the document mask on one rank (the block engine)
        rows = [("allgather", 1, "none")]
        for c in a.cps:
            rows += [(m, c, b) for m in a.methods for b in ("documents", "headtail")
                     if m != "hierarchical" or c > a.ulysses_degree]
    else:
        rows = [("none", 1, "-")] + [("dp", c, "-") for c in a.cps]
        for c in a.cps:
            rows += [(m, c, "headtail") for m in a.methods
                     if m != "hierarchical" or c > a.ulysses_degree]
    if a.unbalanced:
        rows.append(("ring", max(a.cps), "none"))
    model += ["--ulysses-degree", str(a.ulysses_degree), "--documents",
              "1" if a.documents else "0", "--steps", str(a.steps), "--warmup", str(a.warmup)]
    for seq in a.seqs:
        got = {r: [] for r in rows}
        for _ in range(a.rounds):
            for method, n, balance in rows:
                args = ["--method", method, "--seq", str(seq), "--balance",
                        balance if balance != "-" else "none"] + model
                got[(method, n, balance)].append(run(a.torchrun, a.binary, n, args, env))
        base_cpu = statistics.median(sum(r["cpu_ms"]) for r in got[rows[0]])
        print(f"\n### sequence {seq} (dim {a.dim}, {a.layers} layer(s), heads {a.heads}/{a.kv_heads}, "
              f"{a.rounds} rounds{', packed documents' if a.documents else ''})\n")
        print("| layout | ranks | balance | step ms | CPU ms (sum) | CPU / 1 rank | balance max/min | "
              "bytes per rank | formula | K/V peak bytes | live peak MB |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for key in rows:
            method, n, balance = key
            rs = got[key]
            step = statistics.median(r["step_ms"] for r in rs)
            steps = sorted(r["step_ms"] for r in rs)
            cpu = statistics.median(sum(r["cpu_ms"]) for r in rs)
            skew = statistics.median(max(r["cpu_ms"]) / min(r["cpu_ms"]) for r in rs)
            sent = int(max(rs[0]["bytes_in"]))
            kv = int(max(rs[0]["peak_kv_bytes"]))
            live = statistics.median(max(r["live_peak_mb"]) for r in rs)
            layout = {"none": "plain", "dp": "dp"}.get(method, f"cp {method}")
            if method == "hierarchical":
                layout += f" ({a.ulysses_degree} x {n // a.ulysses_degree})"
            if n == 1 and method != "none":
                layout = "document mask, 1 rank"
            print(f"| {layout} | {n} | {balance} | {step:.0f} ({steps[0]:.0f}-{steps[-1]:.0f}) | "
                  f"{cpu:.0f} | {cpu / (n if method == 'dp' else 1) / base_cpu:.2f} | {skew:.2f} | {sent} | "
                  f"{formula(method, n, seq, a, rs[0])} | {kv} | {live:.1f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
