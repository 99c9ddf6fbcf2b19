#!/usr/bin/env python3
"""The recipe with context parallelism learns what it learns without (meson test train_cp-w4).

usage: cp_recipe.py TORCHRUN TRAIN OUTDIR
Runs examples/train for 8 steps in fp32 on tp 2 (2 ranks), then on cp 2 x tp 2 (4 ranks) with
the all-gather and ring methods, on cp 2 (2 ranks) with Ulysses and on cp 4 with the
hierarchical method (all-to-all pairs, ring across them): the same global batch,
the same initial values (docs/random.md), the sequence of each row sharded head-tail over the
cp ranks. Every step's loss and gradient norm must equal
the run without cp within 2e-4 (relative): cp changes where attention is computed, not what.
Then cp inside pipeline stages, pp 2 x cp 2 (4 ranks, 1F1B, all-gather K/V), against the same
run: each stage's attention over its cp group, the hidden states handed between stages as
each cp rank's piece.
"""
import os
import sys

from recipe_runs import compare, run as run_recipe

STEPS = 8
FLAGS = ["--steps", str(STEPS), "--precision", "fp32", "--ac", "none", "--mesh", "1x1x2",
         "--seq", "32", "--batch", "8", "--log-every", "1"]


def run(torchrun, train, nproc, out, extra):
    return run_recipe(torchrun, train, nproc, out, FLAGS, extra)[0]


def main():
    torchrun, train, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    want = run(torchrun, train, 2, out, [])
    ok = True
    for method in ("allgather", "ring"):
        got = run(torchrun, train, 4, out, ["--cp", "2", "--cp-method", method])
        ok = compare(method, got, want) and ok and len(got) == STEPS
    # Ulysses on cp 2 alone: its heads (4 query, 2 key / value) must divide by cp after tp.
    got = run(torchrun, train, 2, out, ["--cp", "2", "--cp-method", "ulysses", "--mesh", "1x1x1"])
    ok = compare("ulysses", got, want) and ok and len(got) == STEPS
    # Hierarchical on cp 4: all-to-alls in pairs of ranks, the ring across the two pairs.
    got = run(torchrun, train, 4, out, ["--cp", "4", "--cp-method", "hierarchical",
                                        "--cp-ulysses-degree", "2", "--mesh", "1x1x1"])
    ok = compare("hierarchical", got, want) and ok and len(got) == STEPS
    got = run(torchrun, train, 4, out, ["--pp", "2", "--cp", "2", "--mesh", "1x1x1"])
    ok = compare("pp2 x cp2", got, want) and ok and len(got) == STEPS
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
