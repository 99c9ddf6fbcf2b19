#!/usr/bin/env python3
"""The tables and chart of docs/simulation.md: Llama 3 8B and 70B planned on 8 to 1,024
ranks with `train --simulate`, and torchtitan's published configurations beside their
figures.

usage: simulation_tables.py TRAIN OUTDIR [--quick]
Writes OUTDIR/<name>/simulation.json per run, OUTDIR/tables.md and OUTDIR/simulation.png.
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# name, model, world, mesh, global batch, AC, published TPS/GPU (torchtitan docs/performance.md)
RUNS = [
    ("8b-8", "llama3-8b", 8, "1x8x1", 16, "selective", "5,762 (Table 1: FSDP, 8 H100, lbs 2)"),
    ("8b-128", "llama3-8b", 128, "1x128x1", 256, "selective",
     "5,605 (Table 3: FSDP, 128 H100, lbs 2)"),
    ("8b-512", "llama3-8b", 512, "1x512x1", 1024, "selective", ""),
    ("8b-1024", "llama3-8b", 1024, "1x1024x1", 2048, "selective", ""),
    ("8b-1024-tp", "llama3-8b", 1024, "8x16x8", 2048, "selective", ""),
    ("70b-256", "llama3-70b", 256, "1x32x8", 512, "full",
     "829 (Table 4: FSDP 32 x TP 8, 256 H100, lbs 16, with torch.compile + Float8)"),
    ("70b-128", "llama3-70b", 128, "1x16x8", 256, "full", ""),
    ("70b-512", "llama3-70b", 512, "1x64x8", 1024, "full", ""),
    ("70b-1024", "llama3-70b", 1024, "2x64x8", 2048, "full", ""),
    ("8b-64", "llama3-8b", 64, "1x64x1", 128, "selective", ""),
    ("70b-64", "llama3-70b", 64, "1x8x8", 128, "full", ""),
]


def gib(b):
    return b / 1024.0 ** 3


def main():
    train, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    rows, summaries = [], []
    for name, model, world, mesh, batch, ac, published in RUNS:
        d = os.path.join(out, name)
        t0 = time.time()
        done = os.path.exists(os.path.join(d, "simulation.json"))  # a rerun keeps finished ones
        p = subprocess.CompletedProcess([], 0, "", "") if done else subprocess.run([train, "--simulate", str(world), "--mesh", mesh, "--model", model,
                            "--seq", "8192", "--batch", str(batch), "--ac", ac, "--sample", "4",
                            "--out", d], capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{name} failed:\n{p.stdout}\n{p.stderr}")
        secs = time.time() - t0
        s = json.load(open(os.path.join(d, "simulation.json")))
        summaries.append(os.path.join(d, "simulation.json"))
        m = s["meshes"][0]
        mem, t = m["memory"], m["time"]
        sent = " / ".join(f"{k} {gib(v):.2f}" for k, v in sorted(m["bytes_by_dim"].items()))
        rows.append(f"| {model[7:]} | {world} | {mesh} | {batch // (world // int(mesh.split('x')[2]))} "
                    f"| {ac} | {gib(mem['parameters']):.2f} | {gib(mem['optimizer']):.2f} "
                    f"| {gib(mem['fsdp_peak']):.2f} | {gib(mem['step_peak']):.1f} | {sent} "
                    f"| {m['flops'] / 1e12:.0f} | {t['step_s']:.2f} | {t['tokens_per_s_per_gpu']:.0f} "
                    f"| {published} | {len(m['ranks'])} in {secs:.0f} s |")
        print(rows[-1], flush=True)
    head = ("| model | ranks | mesh (dp_rep x dp_shard x tp) | local batch | AC | parameters GiB "
            "| AdamW GiB | fully_shard peak GiB | step peak GiB | GiB sent per step by dim "
            "| TFLOP per step | predicted step s | predicted tokens/s/GPU "
            "| torchtitan published tokens/s/GPU | ranks simulated, wall |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    open(os.path.join(out, "tables.md"), "w").write(head + "\n" + "\n".join(rows) + "\n")
    subprocess.run([sys.executable, os.path.join(HERE, "plot_simulation.py"),
                    os.path.join(out, "simulation.png"), *summaries,
                    "--title", "Llama 3 8B / 70B, seq 8192, planned by train --simulate"], check=True)


if __name__ == "__main__":
    main()
