#!/usr/bin/env python3
"""The recipe's learning-rate schedule judged by torchtitan's own (meson test lr_schedule).

usage: lr_schedule_recipe.py TORCHRUN TRAIN OUTDIR
Each case trains a small model for a few steps on one rank and reads the learning rate of
every step from the metrics; torchtitan's LRSchedulersContainer (the torchtitan wheel), built
on a torch optimizer with the same peak learning rate, is stepped as torchtitan's trainer
steps it (the step runs at get_last_lr(), then the scheduler steps). The two must agree to
1e-12 relative at every step: the linear warmup from lr / warmup, the stable phase with its
virtual last step, each decay type, min_lr_factor, a warmup longer than the run, and a
schedule longer than the run (lr_scheduler.total_steps). One case sets the schedule through
torchtitan's `--lr_scheduler.key value` overrides, the others through the flags.
"""
import math
import os
import sys

import torch
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from recipe_runs import run as run_recipe

SMALL = ["--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--seq", "16",
         "--batch", "4", "--vocab", "64", "--precision", "fp32", "--ac", "none",
         "--log-every", "100"]
LR = 0.01

# (label, steps, warmup, decay_ratio (None: after the warmup), decay_type, min_lr_factor,
#  total_steps (None: the run's steps))
CASES = [
    ("linear, decay after the warmup", 10, 2, None, "linear", 0.0, None),
    ("linear, decay_ratio 0.5", 10, 2, 0.5, "linear", 0.0, None),
    ("sqrt, min_lr_factor 0.1", 9, 3, 0.6, "sqrt", 0.1, None),
    ("cosine, min_lr_factor 0.2", 9, 1, 0.7, "cosine", 0.2, None),
    ("warmup longer than the run", 6, 20, None, "linear", 0.0, None),
    ("no warmup, schedule of 12 steps", 9, 0, 0.5, "cosine", 0.0, 12),
]


def torchtitan_lrs(steps, warmup, ratio, decay, min_factor, total):
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = LRSchedulersContainer.Config(warmup_steps=warmup, decay_ratio=ratio,
                                          decay_type=decay, min_lr_factor=min_factor,
                                          total_steps=total)
    schedulers = config.build(optimizers=[opt], training_steps=steps)
    lrs = []
    for _ in range(steps):
        lrs.append(schedulers.schedulers[0].get_last_lr()[0])
        opt.step()
        schedulers.step()
    return lrs


def flags(steps, warmup, ratio, decay, min_factor, total, dotted):
    if dotted:
        out = [f"--lr_scheduler.warmup_steps={warmup}", "--lr_scheduler.decay_type", decay,
               f"--lr_scheduler.min_lr_factor={min_factor}", "--optimizer.lr", str(LR)]
        out += [] if ratio is None else ["--lr_scheduler.decay_ratio", str(ratio)]
        out += [] if total is None else ["--lr_scheduler.total_steps", str(total)]
        return out + ["--training.steps", str(steps)]
    out = ["--warmup-steps", str(warmup), "--decay-type", decay, "--min-lr-factor",
           str(min_factor), "--lr", str(LR), "--decay-ratio", "none" if ratio is None else str(ratio)]
    out += [] if total is None else ["--lr-total-steps", str(total)]
    return out + ["--steps", str(steps)]


def main():
    torchrun, train, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    ok = True
    for i, (label, steps, warmup, ratio, decay, min_factor, total) in enumerate(CASES):
        records = run_recipe(torchrun, train, 1, out,
                             SMALL + flags(steps, warmup, ratio, decay, min_factor, total, i == 1),
                             [])[0]
        got = [r["lr"] for r in records]
        want = torchtitan_lrs(steps, warmup, ratio, decay, min_factor, total)
        same = len(got) == len(want) and all(
            math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18) for a, b in zip(got, want))
        finite = all(math.isfinite(r["loss"]) for r in records)
        print(f"{'ok' if same and finite else 'FAIL'} {label}: {[f'{x:.6g}' for x in got]} "
              f"against torchtitan's {[f'{x:.6g}' for x in want]}")
        ok &= same and finite
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
