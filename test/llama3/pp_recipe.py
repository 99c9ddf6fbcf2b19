#!/usr/bin/env python3
"""The recipe under pipeline parallelism learns what it learns without (meson test train_pp-w4).

usage: pp_recipe.py TORCHRUN TRAIN OUTDIR
Runs examples/train for 6 steps in fp32 with 4 layers on tp 2 (2 ranks), then on pp 2 x tp 2
(4 ranks) with 1F1B (full activation checkpointing) and ZBVZeroBubble (two stages per rank,
split backward). Each pipelined run builds the model on meta, materializes only its stages and
initializes them by the whole model's init ([Note: initializing stages built on meta]): every
step's loss and gradient norm (clipped over every stage, one all-reduce more over pp) must
equal the run without pp within 2e-4 (relative). Rank 0's sends and receives per step are
counted exactly: one per microbatch per stage boundary it touches. The 1F1B run saves a
checkpoint at step 3 (each pipeline rank its stages' names: [Note: names held by some
ranks]); the recipe without pp on 2 ranks resumes it and must go on as the run without pp
did (steps 3-5, and the same closing sample: the same final model). Then flags that cannot
go with --pp are refused by name before anything runs.
"""
import json
import os
import re
import shutil
import subprocess
import sys

STEPS = 6
MICRO = 4  # --microbatches' default, 2 x pp
FLAGS = ["--steps", str(STEPS), "--precision", "fp32", "--layers", "4", "--mesh", "1x1x2",
         "--seq", "16", "--batch", "8", "--log-every", "1"]


def launch(torchrun, train, nproc, args):
    return subprocess.run([torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python",
                           train, *args], capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def run(torchrun, train, nproc, out, extra):
    name = "-".join(extra) or "plain"
    metrics = os.path.join(out, f"metrics-{nproc}-{re.sub('[^A-Za-z0-9]+', '-', name)}.jsonl")
    if os.path.exists(metrics):  # a resumed run appends to its file: start afresh
        os.remove(metrics)
    p = launch(torchrun, train, nproc, [*FLAGS, *extra, "--metrics", metrics])
    print(p.stdout[-2000:])
    if p.returncode != 0:
        print(p.stderr[-3000:])
        sys.exit(f"{name}: exit {p.returncode}")
    sample = [line for line in p.stdout.splitlines() if line.startswith("sample:")]
    return [json.loads(line) for line in open(metrics)], sample


def compare(label, got, want):
    ok = len(got) == len(want)
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm"):
            if abs(a[key] - b[key]) > 2e-4 * abs(b[key]):
                print(f"FAIL {label} step {a['step']}: {key} {a[key]} against {b[key]}")
                ok = False
    print(f"{label}: losses {[round(r['loss'], 5) for r in got]} "
          f"against {[round(r['loss'], 5) for r in want]}")
    return ok


def main():
    torchrun, train, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    want, want_sample = run(torchrun, train, 2, out, ["--ac", "none"])
    ok = len(want) == STEPS and len(want_sample) == 1
    ckpt = os.path.join(out, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)  # a rerun saves afresh
    # Rank 0 holds stage 0 (1F1B: one boundary) or stages 0 and 3 (ZBV: two).
    for schedule, ac, boundaries, extra in (
            ("1F1B", "full", 1, ["--save", ckpt, "--save-every", "3"]),
            ("ZBVZeroBubble", "none", 2, [])):
        got, _ = run(torchrun, train, 4, out,
                     ["--pp", "2", "--pp-schedule", schedule, "--ac", ac, *extra])
        ok = compare(schedule, got, want) and ok
        for a in got:
            for kind in ("send", "recv"):
                if a["collectives"].get(kind) != boundaries * MICRO:
                    print(f"FAIL {schedule} step {a['step']}: {kind} {a['collectives']}")
                    ok = False
    # The pipelined checkpoint resumed without pp, on 2 ranks.
    got, sample = run(torchrun, train, 2, out,
                      ["--ac", "none", "--resume", os.path.join(ckpt, "step-3")])
    ok = compare("resumed without pp", got, want[3:]) and ok
    if sample != want_sample:
        print(f"FAIL resumed without pp: {sample} against {want_sample}")
        ok = False
    # Refused by name, on every rank, before any training (exit 2, the usage error).
    for extra, words in ((["--pp", "2", "--export-hf", os.path.join(out, "hf")],
                          "--pp with --export-hf is not supported yet"),
                         (["--pp", "2", "--layers", "2", "--pp-schedule", "ZBVZeroBubble"],
                          "2 layers cannot fill 4 pipeline stages (ZBVZeroBubble on 2 ranks)")):
        p = launch(torchrun, train, 4, [*FLAGS[:-2], *extra])
        if p.returncode == 0 or words not in p.stderr:
            print(f"FAIL {extra}: exit {p.returncode}, stderr {p.stderr[-1500:]}")
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
