#!/usr/bin/env python3
"""Gradient accumulation in the recipe, judged by the one-rank run of the whole batch
(meson test accumulation-w4).

usage: accumulation_recipe.py TORCHRUN TRAIN OUTDIR
- one rank, --batch 16 in one microbatch (the judge: the plain model on one process);
- four ranks as HSDP (dp_replicate 2 x dp_shard 2), --batch 16 --local-batch 1: each rank's
  4 rows of a step in 4 microbatches;
- the same four ranks without accumulation (--batch 16);
- four ranks as pp 2 x dp_shard 2 (1F1B), --batch 16 --local-batch 2 --microbatches 2: 4
  accumulation steps, each one run of the schedule over 2 pipeline microbatches.
The accumulated runs equal the judge: every step's loss and gradient norm within 1e-5
relative, and (HSDP) every parameter after the last step (both exported to Hugging Face folders, read
with safetensors) within 1e-4 of the tensor's largest value (measured 1.3e-5: fp32 sums run in
another order, and Adam's update divides by the gradients' own scale). Per step, against the run without
accumulation: 4 x the reduce-scatters and all-gathers over dp_shard (one per microbatch), and
the same all-reduces over dp_replicate (HSDP's all-reduce deferred to the last microbatch).
"""
import os
import shutil
import sys

from recipe_runs import compare, hf_tensors, run as run_recipe

SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--seq", "16",
         "--vocab", "64", "--precision", "fp32", "--ac", "none", "--steps", "3",
         "--log-every", "100", "--batch", "16"]
HSDP = ["--dp-replicate", "2", "--dp-shard", "2", "--tp", "1"]


def exported(out, name):
    folder = os.path.join(out, name)
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def counts(record, group, kind):
    return record["collectives_by_group"].get(group, {}).get(kind, 0)


def main():
    torchrun, train, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    judge_dir, accum_dir = exported(out, "judge-hf"), exported(out, "accum-hf")
    judge = run_recipe(torchrun, train, 1, out, SMALL + ["--export-hf", judge_dir],
                       ["--mesh", "1x1x1"])[0]
    accum = run_recipe(torchrun, train, 4, out, SMALL + HSDP + ["--export-hf", accum_dir],
                       ["--local-batch", "1"])[0]
    plain = run_recipe(torchrun, train, 4, out, SMALL + HSDP, ["--local-batch", "0"])[0]
    pp = run_recipe(torchrun, train, 4, out, SMALL + ["--pp", "2", "--mesh", "1x2x1"],
                    ["--local-batch", "2", "--microbatches", "2"])[0]
    ok = compare("4 accumulation steps on 4 ranks against 1 rank", accum, judge, rel=1e-5)
    ok &= compare("pp 2 x dp_shard 2, 4 accumulation steps against 1 rank", pp, judge, rel=1e-5)
    a, b = hf_tensors(accum_dir), hf_tensors(judge_dir)
    worst = max(((x - b[k]).abs().max() / b[k].abs().max()).item() for k, x in a.items())
    same = sorted(a) == sorted(b) and worst < 1e-4
    print(f"{'ok' if same else 'FAIL'} parameters after 3 steps: {len(a)} tensors, worst "
          f"relative difference {worst:.2e}")
    ok &= same
    groups = sorted(accum[0]["collectives_by_group"])
    print(f"groups: {groups}")
    shard = [g for g in groups if "dp_shard" in g and "replicate" not in g]
    replicate = [g for g in groups if "dp_replicate" in g and "shard" not in g]
    for group, kind, factor in [(shard, "reduce_scatter", 4), (shard, "all_gather", 4),
                                (replicate, "all_reduce", 1)]:
        if len(group) != 1:
            print(f"FAIL no single group for {kind}: {group}")
            ok = False
            continue
        got = [counts(r, group[0], kind) for r in accum]
        want = [factor * counts(r, group[0], kind) for r in plain]
        good = got == want and want[0] > 0
        print(f"{'ok' if good else 'FAIL'} {kind} over {group[0]} per step: {got}, "
              f"{factor} x the run without accumulation's: {want}")
        ok &= good
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
