"""The recipe's checkpoint stall: synchronous against asynchronous saves (docs/benchmarks.md).

usage: async_save.py TORCHRUN TRAIN [--rounds R] [--steps N] [--every K]

Runs the Llama 3 recipe (examples/train, the "large" config of llama3_recipe.py) on 8 CPU
ranks (2x2x2) three ways, alternately, R rounds: no checkpoint, --save-every K synchronous,
--save-every K --async-save. Per run it reads the metrics file (each step's time) and the
"saved / saving step N ... in X s" lines (how long the save call held the training loop).
Reported, as medians over rounds (min-max): the step time with no save; the time the loop
stood still per save (sync: the whole write; async: staging to host memory and waiting for the
previous save); the time of the steps that ran while an asynchronous write was in flight (the
K-1 steps after each save), against the steps of the run without saves.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("torchrun")
ap.add_argument("train")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--every", type=int, default=5)
args = ap.parse_args()

config = ["--dim", "256", "--layers", "4", "--heads", "8", "--kv-heads", "4", "--seq", "64",
          "--batch", "32", "--log-every", "1000"]
modes = {"none": [], "sync": ["--save-every", str(args.every)],
         "async": ["--save-every", str(args.every), "--async-save"]}


def run(mode, tmp):
    metrics = os.path.join(tmp, f"{mode}.jsonl")
    cmd = [args.torchrun, "--standalone", "--nproc-per-node=8", "--no-python", args.train,
           "--mesh", "2x2x2", "--steps", str(args.steps), "--metrics", metrics] + config
    if modes[mode]:
        cmd += ["--save", os.path.join(tmp, f"ckpt-{mode}")] + modes[mode]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stdout}\n{out.stderr}")
    steps = [json.loads(l) for l in open(metrics)]
    stalls = [float(x) for _, x in re.findall(r"(?:saved|saving) step (\d+) to \S+ in ([0-9.]+) s", out.stdout)]
    # Steps after the first few (warm-up), and of those the ones right after a save.
    times = {s["step"]: s["step_s"] for s in steps if s["step"] >= 3}
    after = [t for s, t in times.items() if s % args.every != 0 and s > args.every]
    return {"step": statistics.median(times.values()), "after_save": statistics.median(after),
            "stall": statistics.median(stalls[:-1]) if len(stalls) > 1 else None}


results = {m: [] for m in modes}
with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
        for mode in modes:
            results[mode].append(run(mode, tmp))
            print(f"round {r} {mode}: {results[mode][-1]}", flush=True)


def med(mode, key):
    v = [x[key] for x in results[mode] if x[key] is not None]
    return statistics.median(v), min(v), max(v)


base = med("none", "step")
print(f"\nLlama 3 recipe, 8 CPU ranks (2x2x2), dim 256, 4 layers, save every {args.every} steps, "
      f"{args.rounds} rounds (median, min-max):")
print(f"  step time, no checkpoint:                {base[0]*1e3:7.1f} ms ({base[1]*1e3:.1f}-{base[2]*1e3:.1f})")
for mode in ("sync", "async"):
    s = med(mode, "stall")
    a = med(mode, "after_save")
    print(f"  {mode:5s}: loop held per save          {s[0]*1e3:7.1f} ms ({s[1]*1e3:.1f}-{s[2]*1e3:.1f}); "
          f"steps after a save {a[0]*1e3:.1f} ms ({a[0]/base[0]:.2f}x the no-checkpoint step)")
