#!/usr/bin/env python3
"""Published training rows against the layout search (docs/simulation.md, "Choosing the layout").

usage: scripts/plan_published.py TRAIN [--markdown]

For each row: `TRAIN --plan` searches every layout of the row's world on the row's cluster
(H100, 8 a node; torchtitan's GPUs with 95 GiB, NVIDIA's with 80), and `--find` places the
published layout in that ranking and plans it. Prints, per row, the published layout's planned
tokens/s per GPU and memory against the published figures, its rank among the layouts that
fit, and the search's best layout.
"""
import json
import os
import subprocess
import sys
import tempfile

# (row, model, world, seq, global batch, float8, memory GiB, published layout for --find,
#  published tok/s/GPU, published GiB or None). The published runs' overlaps are planned too:
#  torchtitan's 405B rows ran asynchronous TP; NVIDIA's recipes overlap TP's collectives and
#  the experts' all-to-alls with compute (OVERLAP below).
ROWS = [
    ("torchtitan 8B FSDP 8", "llama3-8b", 8, 8192, 16, False, 95,
     "dp_shard=8,ac=selective,mb=2", 5762, 82.4),
    ("torchtitan 8B FSDP 128", "llama3-8b", 128, 8192, 256, False, 95,
     "dp_shard=128,ac=selective,mb=2", 5605, None),
    ("torchtitan 70B FSDP 32 TP 8", "llama3-70b", 256, 8192, 512, True, 95,
     "tp=8,ac=full,mb=16", 829, 71.9),
    ("torchtitan 8B FSDP 8 CP 1, 32k", "llama3-8b", 8, 32768, 8, True, 95,
     "dp_shard=8,ac=full,mb=1", 3890, 83.9),
    ("torchtitan 8B FSDP 4 CP 2, 64k", "llama3-8b", 8, 65536, 4, True, 95,
     "cp=2,ac=full,mb=1,method=allgather", 2540, 84.2),
    ("torchtitan 8B FSDP 2 CP 4, 128k", "llama3-8b", 8, 131072, 2, True, 95,
     "cp=4,ac=full,mb=1,method=allgather", 1071, 84.0),
    ("torchtitan 8B FSDP 1 CP 8, 256k", "llama3-8b", 8, 262144, 1, True, 95,
     "cp=8,ac=full,mb=1,method=allgather", 548, 84.5),
    ("torchtitan 405B FSDP 8 TP 8 PP 8 1F1B", "llama3-405b", 512, 8192, 256, True, 95,
     "tp=8,pp=8,ac=full,mb=1", 100, 82.5),
    ("torchtitan 405B FSDP 8 TP 8 PP 8 Interleaved", "llama3-405b", 512, 8192, 256, True, 95,
     "tp=8,pp=8,v=2,ac=full,mb=1", 128, 72.7),
    ("Megatron-Bridge 70B TP4 PP8 VP5", "llama3-70b", 64, 8192, 256, True, 80,
     "tp=4,pp=8,v=5", 1621, None),
    ("Megatron-Bridge 405B TP8 PP8 CP2 VP8", "llama3-405b", 1024, 8192, 1536, True, 80,
     "tp=8,pp=8,cp=2,v=8", 311, None),
    ("Megatron-Bridge DeepSeek-V3 TP2 PP8 VP4 EP64", "deepseek-v3", 1024, 4096, 8192, True, 80,
     "tp=2,pp=8,v=4,ep=64", 1297, None),
    ("Megatron-Bridge Qwen3-30B-A3B PP2 VP12 EP8", "qwen3-30b-a3b", 16, 4096, 1024, True, 80,
     "pp=2,v=12,ep=8", 2557, None),
    ("Megatron-Bridge Qwen3-235B-A22B TP2 PP8 VP4 EP32", "qwen3-235b-a22b", 256, 4096, 8192, True,
     80, "tp=2,pp=8,v=4,ep=32", 1633, None),
    ("Megatron-Bridge GPT-OSS 120B PP4 EP8", "gpt-oss-120b", 64, 4096, 1280, False, 80,
     "pp=4,ep=8", 5993, None),
]


OVERLAP = {"torchtitan 405B": ["--tp-overlap"], "Megatron-Bridge": ["--tp-overlap", "--ep-overlap"]}


def overlaps(name):
    return [f for prefix, flags in OVERLAP.items() if name.startswith(prefix) for f in flags]


def plan(train, row):
    name, model, world, seq, batch, float8, gib, find, _, _ = row
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        args = [train, "--plan", "1", "--model", model, "--world", str(world), "--seq", str(seq),
                "--global-batch", str(batch), "--memory-gib", str(gib), "--find", find,
                "--json", out] + (["--float8"] if float8 else []) + overlaps(name)
        p = subprocess.run(args, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{name}: {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}")
        return json.load(open(out))


def main():
    train = sys.argv[1]
    print("| row | planned variant | tok/s/GPU planned | published | ratio | GiB planned | "
          "published | ratio | the published mesh ranks | the search's best | its tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for row in ROWS:
        name, tok, gib = row[0], row[8], row[9]
        r = plan(train, row)
        found, best = r["found"], r["ranked"][0] if r["ranked"] else None
        mine = found["tokens_per_s_per_gpu"]
        mem = found["memory_gib"]["total"]
        rank = f"#{found['rank']} of {len(r['ranked'])}" if found["rank"] else "not ranked"
        variant = found["layout"].split(", ", 1)[1]  # ep, AC and microbatch
        mem_cells = f"{mem:.1f} | {gib} | {mem / gib:.2f}" if gib else f"{mem:.1f} | | "
        print(f"| {name} | {variant} | {mine:.0f} | {tok:,} | {mine / tok:.2f} | {mem_cells} | "
              f"{rank} | {best['layout'] if best else ''} | "
              f"{best['tokens_per_s_per_gpu']:.0f} |")


if __name__ == "__main__":
    main()
