#!/usr/bin/env python3
"""The layout search's ranking beside a measured sweep of the same layouts (docs/benchmarks.md,
"The layout search against a measured sweep").

usage: bench/plan_sweep.py TRAIN TORCHRUN [--rounds R] [--steps S]

On 8 ranks of this machine (Gloo, the `cpu` row of the cluster table), a small Llama (dim 256,
4 blocks, 8 heads of 32, 4 K/V heads, sequences of 256, 16 a step, no checkpointing) runs each
layout below for S steps, R rounds alternating the layouts; the median step of each run's
last S - 2 steps is its time. `train --plan --find ...` plans each layout exactly (the same
microbatch and mode). Prints per layout the planned and measured step, the rank correlation
(Spearman) between the two orders, and the measured time of the planned best against the
measured best.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODEL = ["--dim", "256", "--layers", "4", "--heads", "8", "--kv-heads", "4", "--vocab", "1024"]
# The recipe's FeedForward width for dim 256 (2/3 of 4 x dim, to a multiple of 32), its
# vocabulary of 1,024 pieces (a tokenizer trained on the demo's corpus, the fortune files).
SHAPE = "dim=256,layers=4,heads=8,kv_heads=4,head_dim=32,ffn=704,vocab=1024"
FORTUNES = "/usr/share/games/fortunes"
SEQ, BATCH, WORLD = 256, 16, 8
# (recipe flags, --find keys): dp_replicate x dp_shard x tp meshes, cp and pp.
LAYOUTS = [
    (["--mesh", "1x8x1"], "dp_shard=8"),
    (["--mesh", "8x1x1"], "dp_rep=8"),
    (["--mesh", "2x4x1"], "dp_rep=2,dp_shard=4"),
    (["--mesh", "1x4x2"], "dp_shard=4,tp=2"),
    (["--mesh", "1x2x4"], "dp_shard=2,tp=4"),
    (["--mesh", "1x4x1", "--cp", "2"], "dp_shard=4,cp=2"),
    (["--mesh", "1x2x2", "--cp", "2"], "dp_shard=2,tp=2,cp=2"),
    (["--mesh", "1x4x1", "--pp", "2", "--pp-schedule", "1F1B", "--microbatches", "4"],
     "dp_shard=4,pp=2"),
]


def local_batch(find):
    keys = dict(kv.split("=") for kv in find.split(","))
    dp = int(keys.get("dp_rep", 1)) * int(keys.get("dp_shard", 1))
    micro = 4 if "pp" in keys else 1
    return BATCH // dp // micro


def planned(train, find):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        subprocess.run([train, "--plan", "1", "--shape", SHAPE, "--world", str(WORLD), "--seq",
                        str(SEQ), "--global-batch", str(BATCH), "--cluster", "cpu",
                        "--memory-gib", "1000", "--find",
                        f"{find},ac=none,mb={local_batch(find)}", "--json", out],
                       check=True, capture_output=True)
        return json.load(open(out))["found"]["time_s"]["step"]


def measured(train, torchrun, flags, steps):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        data = ",".join(sorted(os.path.join(FORTUNES, f) for f in os.listdir(FORTUNES)
                               if "." not in f))
        p = subprocess.run([torchrun, "--standalone", f"--nproc-per-node={WORLD}", "--no-python",
                            train, *MODEL, *flags, "--data", data, "--seq", str(SEQ),
                            "--batch", str(BATCH),
                            "--steps", str(steps), "--ac", "none", "--metrics", metrics],
                           env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{' '.join(flags)} failed:\n{p.stdout[-3000:]}\n{p.stderr[:3000]}")
        rows = [json.loads(line) for line in open(metrics)]
        return statistics.median(r["step_s"] for r in rows[2:])


def ranks(values):
    order = sorted(range(len(values)), key=lambda i: values[i])
    r = [0] * len(values)
    for position, i in enumerate(order):
        r[i] = position
    return r


def spearman(a, b):
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("train")
    ap.add_argument("torchrun")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    plans = [planned(a.train, find) for _, find in LAYOUTS]
    times = [[] for _ in LAYOUTS]
    for _ in range(a.rounds):  # alternating: every layout once a round
        for i, (flags, _) in enumerate(LAYOUTS):
            times[i].append(measured(a.train, a.torchrun, flags, a.steps))
    medians = [statistics.median(t) for t in times]
    print("| layout | planned step ms | measured step ms (median; min-max over rounds) |")
    print("|---|---:|---:|")
    for (flags, find), p, t, m in zip(LAYOUTS, plans, times, medians):
        print(f"| {find} | {1e3 * p:.1f} | {1e3 * m:.1f} ({1e3 * min(t):.1f}-{1e3 * max(t):.1f}) |")
    best_planned = min(range(len(plans)), key=lambda i: plans[i])
    best_measured = min(range(len(medians)), key=lambda i: medians[i])
    result = {"spearman": round(spearman(plans, medians), 3),
              "planned_best": LAYOUTS[best_planned][1],
              "planned_best_measured_ms": round(1e3 * medians[best_planned], 1),
              "measured_best": LAYOUTS[best_measured][1],
              "measured_best_ms": round(1e3 * medians[best_measured], 1)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
