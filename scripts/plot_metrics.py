#!/usr/bin/env python3
"""The main job's loss curve: reads the metrics file examples/train writes (JSON lines, one
object per step) and draws the training loss, the validation loss (the steps that have one,
--val-every) and tokens/s against the step, and below them the learning rate of every step
(the schedule: docs/recipe.md), into a PNG.

usage: plot_metrics.py METRICS.jsonl OUT.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def main():
    metrics, out = sys.argv[1:3]
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    if not rows:
        raise SystemExit(f"plot_metrics: {metrics} holds no steps")
    steps = [r["step"] for r in rows]
    has_lr = all("lr" in r for r in rows)
    if has_lr:
        fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(7, 5.2), sharex=True,
                                             gridspec_kw={"height_ratios": [3, 1]})
    else:
        fig, loss_ax = plt.subplots(figsize=(7, 4))
    loss_ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", label="training loss")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        loss_ax.plot([s for s, _ in val], [v for _, v in val], color="tab:orange", marker="o",
                     label="validation loss (held-out documents)")
        loss_ax.legend(loc="upper right")
    if has_lr:
        lr_ax.plot(steps, [r["lr"] for r in rows], color="tab:green")
        lr_ax.set_ylabel("learning rate", color="tab:green")
        lr_ax.set_xlabel("step")
    else:
        loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (cross-entropy)", color="tab:blue")
    speed_ax = loss_ax.twinx()
    speed_ax.plot(steps, [r["tokens_per_s"] for r in rows], color="tab:gray", alpha=0.5,
                  linewidth=0.8, label="tokens/s")
    speed_ax.set_ylabel("tokens/s", color="tab:gray")
    loss_ax.set_title("dtensor: Llama 3 recipe")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"loss curve: {out}")


if __name__ == "__main__":
    main()
