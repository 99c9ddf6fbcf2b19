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
did (steps 3-5, and the same closing sample: the same final model). The pipelined runs
sample through their stages (each stage's output handed to the next over pp): the 1F1B run's
sample must be the run without pp's. The ZBV run exports a Hugging Face folder from its stages
(every rank writes its stages' tensors): each tensor must equal the run without pp's export
within 2e-4 (relative to its largest value). A pipelined run started from the export without
pp (--init-from-hf) must take the steps the run without pp takes from it. Then a layout that
cannot be is refused by name before anything runs.
"""
import os
import shutil
import sys

from recipe_runs import compare, hf_tensors, launch, run as run_recipe

STEPS = 6
MICRO = 4  # --microbatches' default, 2 x pp
FLAGS = ["--steps", str(STEPS), "--precision", "fp32", "--layers", "4", "--mesh", "1x1x2",
         "--seq", "16", "--batch", "8", "--log-every", "1"]


def run(torchrun, train, nproc, out, extra):
    return run_recipe(torchrun, train, nproc, out, FLAGS, extra)


def same_exports(label, got_dir, want_dir):
    got, want = hf_tensors(got_dir), hf_tensors(want_dir)
    ok = sorted(got) == sorted(want) and len(want) > 0
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.shape != w.shape or \
                (g - w).abs().max() > 2e-4 * max(w.abs().max().item(), 1e-12):
            print(f"FAIL {label}: {name} differs from the export without pp")
            ok = False
    print(f"{label}: {len(got)} tensors against {len(want)}{'' if ok else '  FAIL'}")
    return ok


def main():
    torchrun, train, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    hf_plain, hf_pp = os.path.join(out, "hf-plain"), os.path.join(out, "hf-pp")
    for d in (hf_plain, hf_pp):
        shutil.rmtree(d, ignore_errors=True)  # a rerun exports afresh
    want, want_sample = run(torchrun, train, 2, out, ["--ac", "none", "--export-hf", hf_plain])
    ok = len(want) == STEPS and len(want_sample) == 1
    ckpt = os.path.join(out, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)  # a rerun saves afresh
    # Rank 0 holds stage 0 (1F1B: one boundary) or stages 0 and 3 (ZBV: two).
    for schedule, ac, boundaries, extra in (
            ("1F1B", "full", 1, ["--save", ckpt, "--save-every", "3"]),
            ("ZBVZeroBubble", "none", 2, ["--export-hf", hf_pp])):
        got, sample = run(torchrun, train, 4, out,
                          ["--pp", "2", "--pp-schedule", schedule, "--ac", ac, *extra])
        ok = compare(schedule, got, want) and ok
        if schedule == "1F1B" and sample != want_sample:
            print(f"FAIL 1F1B's sample through the stages: {sample} against {want_sample}")
            ok = False
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
    ok = same_exports("ZBV's export from its stages", hf_pp, hf_plain) and ok
    # Each stage read from the export without pp: the same next steps as without pp.
    start = ["--ac", "none", "--init-from-hf", hf_plain, "--steps", "2"]
    want_hf, _ = run(torchrun, train, 2, out, start)
    got_hf, _ = run(torchrun, train, 4, out, ["--pp", "2", *start])
    ok = compare("1F1B from the Hugging Face folder", got_hf, want_hf) and ok
    # Refused by name, on every rank, before any training (exit 2, the usage error).
    for extra, words in ((["--pp", "2", "--layers", "2", "--pp-schedule", "ZBVZeroBubble"],
                          "2 layers cannot fill 4 pipeline stages (ZBVZeroBubble on 2 ranks)"),):
        p = launch(torchrun, train, 4, [*FLAGS[:-2], *extra])
        if p.returncode == 0 or words not in p.stderr:
            print(f"FAIL {extra}: exit {p.returncode}, stderr {p.stderr[-1500:]}")
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
