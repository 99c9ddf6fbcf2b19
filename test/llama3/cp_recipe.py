#!/usr/bin/env python3
"""The recipe with context parallelism learns what it learns without (meson test train_cp-w4).

usage: cp_recipe.py TORCHRUN TRAIN OUTDIR
Runs examples/train for 8 steps in fp32 on tp 2 (2 ranks), then on cp 2 x tp 2 (4 ranks) with
each method: the same global batch, the same initial values (docs/random.md), the sequence of
each row sharded head-tail over the cp ranks. Every step's loss and gradient norm must equal
the run without cp within 2e-4 (relative): cp changes where attention is computed, not what.
"""
import json
import os
import subprocess
import sys

STEPS = 8
FLAGS = ["--steps", str(STEPS), "--precision", "fp32", "--ac", "none", "--mesh", "1x1x2",
         "--seq", "32", "--batch", "8", "--log-every", "1"]


def run(torchrun, train, nproc, out, extra):
    metrics = os.path.join(out, f"metrics-{nproc}-{'-'.join(extra) or 'plain'}.jsonl")
    p = subprocess.run([torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python",
                        train, *FLAGS, *extra, "--metrics", metrics],
                       capture_output=True, text=True, timeout=280,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    print(p.stdout[-3000:])
    if p.returncode != 0:
        print(p.stderr[-3000:])
        sys.exit(f"{' '.join(extra) or 'plain'}: exit {p.returncode}")
    return [json.loads(line) for line in open(metrics)]


def main():
    torchrun, train, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    want = run(torchrun, train, 2, out, [])
    ok = True
    for method in ("allgather", "ring"):
        got = run(torchrun, train, 4, out, ["--cp", "2", "--cp-method", method])
        for a, b in zip(got, want):
            for key in ("loss", "grad_norm"):
                if abs(a[key] - b[key]) > 2e-4 * abs(b[key]):
                    print(f"FAIL {method} step {a['step']}: {key} {a[key]} against {b[key]}")
                    ok = False
        print(f"{method}: losses {[round(r['loss'], 5) for r in got]} "
              f"against {[round(r['loss'], 5) for r in want]}")
        ok = ok and len(got) == len(want) == STEPS
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
