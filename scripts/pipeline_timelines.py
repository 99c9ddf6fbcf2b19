"""Draws the timed simulation of every pipeline schedule (docs/pipeline.md's picture).

usage: .venv/bin/python scripts/pipeline_timelines.py build/test/pipeline_dump_orders OUT.png
       [--pp 4] [--microbatches 8]

Runs the dump program's `timeline` command (dtensor::simulate_schedule with unit costs:
F = I = W = 1, B = 2, no latency) for each schedule, then draws one row per rank: forwards
blue, full backwards green, input-gradient halves orange, weight-gradient halves purple,
DualPipeV's overlapped forward + backward steps red, each labelled with its action; the
title gives the makespan and bubble.
"""
import argparse
import subprocess

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2),
             ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)]
COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#dd8452", "W": "#8172b3", "FB": "#c44e52"}


def timelines(program, pp, m):
    cmds = "".join(f"timeline {k} {pp} {m} {v}\n" for k, v in SCHEDULES)
    out = subprocess.run([program], input=cmds, capture_output=True, text=True, check=True).stdout
    result, current = {}, None
    for line in out.splitlines():
        words = line.split()
        if line.startswith("== simulate"):
            current = words[2]
            result[current] = {"actions": []}
        elif line.startswith("ERROR"):
            raise SystemExit(f"{current}: {line}")
        elif words and words[0] == "timeline":
            result[current]["makespan"] = float(words[2])
            result[current]["bubble"] = float(words[4])
        elif words and words[0] == "action":
            result[current]["actions"].append((int(words[1]), float(words[2]), float(words[3]),
                                               words[4]))
    return result


def label_of(action):
    """(colour key, label) of an action's text: "2F0" -> F, "2F0"; a DualPipeV step
    "(0F3;1B2)OVERLAP_F_B" -> FB, "0F3/1B2"."""
    if action.endswith("OVERLAP_F_B"):
        return "FB", action[1:action.index(")")].replace(";", "/")
    for c in "FBIW":
        stage, _, mb = action.partition(c)
        if stage.isdigit() and mb.isdigit():
            return c, action
    return "F", action


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("program")
    ap.add_argument("out")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    data = timelines(args.program, args.pp, args.microbatches)
    fig, axes = plt.subplots(len(SCHEDULES), 1, figsize=(14, 2.0 * len(SCHEDULES)))
    width = max(d["makespan"] for d in data.values())
    for ax, (kind, v) in zip(axes, SCHEDULES):
        d = data[kind]
        for rank, start, end, action in d["actions"]:
            c, label = label_of(action)
            ax.barh(rank, end - start, left=start, color=COLOURS[c], edgecolor="white")
            ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=5,
                    color="white")
        ax.set_xlim(0, width)
        ax.set_ylim(args.pp - 0.5, -0.5)
        ax.set_yticks(range(args.pp))
        ax.set_yticklabels([f"rank {r}" for r in range(args.pp)], fontsize=7)
        ax.set_title(f"{kind} (p={args.pp}, m={args.microbatches}, v={v}): makespan "
                     f"{d['makespan']:g}, bubble {d['bubble']:.3f}", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel("time (unit costs: F = I = W = 1, B = 2)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
