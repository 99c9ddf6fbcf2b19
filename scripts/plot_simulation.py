#!/usr/bin/env python3
"""Draws `train --simulate` summaries (docs/simulation.md): per mesh, the memory of the
largest simulated rank by category and the bytes it sends per step by mesh dimension.

usage: plot_simulation.py OUT.png SIMULATION.json [SIMULATION.json ...] [--title T]
Each SIMULATION.json is the driver's OUT/simulation.json (one world, one or more meshes).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GIB = 1024.0 ** 3
CATEGORIES = [("parameters", "parameters (fp32 shards)"), ("gradients", "gradients"),
              ("optimizer", "AdamW state"), ("fsdp_peak", "fully_shard unsharded (bf16)"),
              ("activations", "activations and temporaries")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("png")
    ap.add_argument("summaries", nargs="+")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    labels, memory, traffic = [], [], []
    for path in a.summaries:
        s = json.load(open(path))
        for m in s["meshes"]:
            labels.append(f"{s['world']}\n{m['mesh']}")
            memory.append(m["memory"])
            traffic.append(m["bytes_by_dim"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10, 1.5 * len(labels)), 5.5))
    x = range(len(labels))
    bottom = [0.0] * len(labels)
    for key, name in CATEGORIES:
        v = [max(0, m[key]) / GIB for m in memory]
        left.bar(x, v, bottom=bottom, label=name)
        bottom = [b + w for b, w in zip(bottom, v)]
    left.plot(x, [m["step_peak"] / GIB for m in memory], "k_", markersize=24,
              label="step peak (simulated device)")
    left.set_xticks(list(x), labels, fontsize=8)
    left.set_ylabel("GiB per rank (largest simulated rank)")
    left.set_title("memory per rank")
    left.legend(fontsize=7)
    dims = sorted({d for t in traffic for d in t})
    width = 0.8 / max(1, len(dims))
    for i, d in enumerate(dims):
        right.bar([xi + i * width for xi in x], [t.get(d, 0) / GIB for t in traffic], width,
                  label=d)
    right.set_xticks([xi + 0.4 - width / 2 for xi in x], labels, fontsize=8)
    right.set_ylabel("GiB sent per step (bytes handed to collectives)")
    right.set_title("communication per step by mesh dimension")
    right.legend(fontsize=7)
    fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
