#!/usr/bin/env python3
"""torchtitan's published rows beside `train --simulate`'s plans (docs/simulation.md,
"Against the published rows"): runs the planner for each row whose layout it can simulate
and prints a Markdown table: predicted and published tokens/s per GPU and memory per GPU,
with their ratios (the goal: tok/s within 25%, memory within 10%).

usage: simulate_published.py TRAIN [OUTDIR [ROW_PREFIX]]
Rows (the notes' parallelism anchors): Llama 3.1 8B on 8 H100s with FSDP x CP = 8x1, 4x2, 2x4,
1x8 at 32k-256k tokens (batch 1, full AC; published with torch.compile and float8), and the
405B rows on 512 H100s (FSDP 8 x TP 8 x PP 8, 1F1B and Interleaved 1F1B, 32 sequences of
8192 per data-parallel rank in microbatches of one, full AC).
"""
import json
import os
import subprocess
import sys

GIB = 1024 ** 3
ROWS = [
    # label, world, mesh (dp_replicate x dp_shard x tp), extra flags, tok/s/GPU, GiB
    ("8B FSDP8 CP1 32k", 8, "1x8x1", ["--seq", "32768"], 3890, 83.9),
    ("8B FSDP4 CP2 64k", 8, "1x4x1", ["--cp", "2", "--seq", "65536"], 2540, 84.2),
    ("8B FSDP2 CP4 128k", 8, "1x2x1", ["--cp", "4", "--seq", "131072"], 1071, 84.0),
    ("8B FSDP1 CP8 256k", 8, "1x1x1", ["--cp", "8", "--seq", "262144"], 548, 84.5),
    # batch 32 per data-parallel rank (256 in all), microbatches of one sequence
    ("405B FSDP8 TP8 PP8 1F1B", 512, "1x8x8",
     ["--pp", "8", "--pp-schedule", "1F1B", "--microbatches", "32", "--seq", "8192"], 100, 82.5),
    ("405B FSDP8 TP8 PP8 Interleaved 1F1B", 512, "1x8x8",
     ["--pp", "8", "--pp-schedule", "Interleaved1F1B", "--microbatches", "32", "--seq", "8192"],
     128, 72.7),
]


def plan(train, out, label, world, mesh, extra):
    model = "llama3-405b" if label.startswith("405B") else "llama3-8b"
    d = os.path.join(out, label.replace(" ", "_"))
    dims = [int(x) for x in mesh.split("x")]
    # torchtitan's batch is per data-parallel rank (local_batch_size); ours is global.
    batch = (1 if model == "llama3-8b" else 32) * dims[0] * dims[1]
    args = [train, "--simulate", str(world), "--mesh", mesh, "--model", model, "--batch",
            str(batch), "--ac", "full", "--out", d, *extra]
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        return None, (p.stderr.strip() or p.stdout.strip()).splitlines()[-1]
    m = json.load(open(os.path.join(d, "simulation.json")))["meshes"][0]
    return (m["time"]["tokens_per_s_per_gpu"], m["memory"]["step_peak"] / GIB), ""


def main():
    train = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else "train-out/published"
    only = sys.argv[3] if len(sys.argv) > 3 else ""  # a label prefix: those rows alone
    print("| row | tok/s/GPU planned | published | ratio | GiB planned | published | ratio |")
    print("|---|---|---|---|---|---|---|")
    for label, world, mesh, extra, tps, gib in ROWS:
        if not label.startswith(only):
            continue
        got, why = plan(train, out, label, world, mesh, extra)
        if got is None:
            print(f"| {label} | not planned: {why} | {tps} | | | {gib} | |")
            continue
        print(f"| {label} | {got[0]:.0f} | {tps} | {got[0] / tps:.2f} | {got[1]:.1f} | {gib} | "
              f"{got[1] / gib:.2f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
