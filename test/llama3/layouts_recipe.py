#!/usr/bin/env python3
"""The recipe composes every dimension on real text (meson test train_layouts-w8).

usage: layouts_recipe.py TORCHRUN TRAIN FORTUNES_DIR OUTDIR
Trains examples/train on three fortune files (Debian's `fortunes`, scripts/setup.sh installs
it) in fp32 through the packed loader, with a SentencePiece BPE trained on them and the
held-out validation loss, in three 8-rank layouts:
  - Llama, pp 2 x dp_shard 2 x tp 2 (1F1B),
  - Llama, cp 2 x dp_shard 2 x tp 2 (all-gather K/V, head-tail balanced),
  - the DeepSeek-V3-style MoE model, dp_replicate 2 x dp_shard 2 x tp 2 with ep 4,
each for 40 steps. The judge is the plain model on one process: the 1-rank run of the same
config. Each layout's first 3 losses and gradient norms must equal it within 1e-4 (relative;
measured 1e-7: fp32, the same data and initial values on every layout), and its global batches
must be the same (the batch digest of every step: the sum over the data-parallel ranks of a
hash of each row at its global index). Over 40 steps the loss must fall (the last 5 steps'
mean below 0.85 of the first 5's) and the validation loss too (step 39's below step 19's).
Then pipeline parallelism with the other dimensions inside its stages, 3 steps each against the
same 1-rank runs: Llama, pp 2 x cp 2 x tp 2, and the MoE model, pp 2 x dp_shard 2 x tp 2 with
ep 4 (the experts' all-to-alls inside each stage), by capacity dispatch in overlapped chunks
(factor 4 = ep: room for every row, so the same values). Muon (--optimizer Muon) on
pp 2 x dp_shard 2 x tp 2, and on the MoE model as dp_replicate 2 x dp_shard 2 x tp 2 with ep 4,
3 steps each against the 1-rank Muon runs, the first saved after step 2 and resumed on 4
ranks as dp_shard 4 for its third step (the same loss within 1e-4). Then the pp run's
step-20 checkpoint is resumed on 4 ranks as dp_shard 4 (another mesh, other data-parallel
splits): steps 20-22 must load the same global batches, token for token (equal
digests), and their losses equal the pp run's within 1e-4. Last, the MoE model in bf16 mixed
precision for 3 steps on dp_shard 4 x tp 2 with ep 4 against one rank, within 1e-3.
"""
import json
import math
import os
import shutil
import sys

from recipe_runs import fortune_files, run as run_recipe

FILES = ["fortunes", "literature", "wisdom"]
STEPS = 40


def flags(data):
    return ["--data", ",".join(data), "--vocab", "256", "--precision", "fp32", "--seq", "32",
            "--batch", "16", "--log-every", "10", "--val-every", "20"]


def check_first_steps(label, got, want):
    ok = True
    for a, b in zip(got[:3], want[:3]):
        for key in ("loss", "grad_norm"):
            if abs(a[key] - b[key]) > 1e-4 * abs(b[key]):
                print(f"FAIL {label} step {a['step']}: {key} {a[key]} against one rank's {b[key]}")
                ok = False
        if a["batch_digest"] != b["batch_digest"]:
            print(f"FAIL {label} step {a['step']}: another global batch than one rank's")
            ok = False
    print(f"{label}: first losses {[round(r['loss'], 6) for r in got[:3]]} against one rank's "
          f"{[round(r['loss'], 6) for r in want[:3]]}")
    return ok


def check_falls(label, got):
    first = sum(r["loss"] for r in got[:5]) / 5
    last = sum(r["loss"] for r in got[-5:]) / 5
    val = {r["step"]: r["val_loss"] for r in got if "val_loss" in r}
    ok = len(got) == STEPS and last < 0.85 * first and val.get(39, math.inf) < val.get(19, 0)
    print(f"{label}: loss {first:.4f} -> {last:.4f} (first and last 5 steps), validation "
          f"{val.get(19)} -> {val.get(39)}{'' if ok else '  FAIL'}")
    return ok


def main():
    torchrun, train, fortunes, out = sys.argv[1:5]
    data = fortune_files(fortunes, FILES)
    os.makedirs(out, exist_ok=True)
    base = flags(data)

    def run(nproc, extra, steps=STEPS):
        return run_recipe(torchrun, train, nproc, out, base + ["--steps", str(steps)], extra)[0]

    ok = True
    dense1 = run(1, [], 3)
    moe_flags = ["--model", "deepseek-v3"]
    moe1 = run(1, moe_flags, 3)
    ckpt = os.path.join(out, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)  # a rerun saves afresh
    layouts = [
        ("pp2 x dp_shard2 x tp2", ["--pp", "2", "--mesh", "1x2x2", "--save", ckpt,
                                    "--save-every", "20"], dense1),
        ("cp2 x dp_shard2 x tp2", ["--cp", "2", "--dp-shard", "2", "--tp", "2"], dense1),
        ("deepseek-v3 dp_replicate2 x dp_shard2 x tp2, ep4",
         moe_flags + ["--mesh", "2x2x2", "--ep", "4"], moe1),
    ]
    runs = {}
    for label, extra, judge in layouts:
        got = run(8, extra)
        runs[label] = got
        ok = check_first_steps(label, got, judge) and ok
        ok = check_falls(label, got) and ok
    # Pipeline stages with context parallelism, and with expert parallelism, inside.
    for label, extra, judge in (
            ("pp2 x cp2 x tp2", ["--pp", "2", "--cp", "2", "--mesh", "1x1x2"], dense1),
            ("deepseek-v3 pp2 x dp_shard2 x tp2, ep4 capacity dispatch, overlapped chunks",
             moe_flags + ["--pp", "2", "--mesh", "1x2x2", "--ep", "4", "--ep-dispatch",
                          "capacity", "--ep-capacity-factor", "4", "--ep-overlap"], moe1)):
        got = run(8, extra, 3)
        ok = check_first_steps(label, got, judge) and len(got) == 3 and ok
    # Muon (the blocks' matrices, experts included; AdamW for the rest) on pipeline stages of
    # FSDP x TP, and on the MoE model under HSDP x TP with EP x efsdp: one rank's first losses
    # (one rank's Muon is judged by torch.optim.Muon in test_muon).
    # The pp run saves after 2 steps; its third step resumed on dp_shard 4 (the optimizer's
    # state on another layout) gives the same loss.
    muon = ["--optimizer", "Muon"]
    muon_ckpt = os.path.join(out, "ckpt_muon")
    shutil.rmtree(muon_ckpt, ignore_errors=True)
    muon_runs = []
    for label, extra, one in (
            ("Muon, pp2 x dp_shard2 x tp2",
             ["--pp", "2", "--mesh", "1x2x2", "--save", muon_ckpt, "--save-every", "2"], []),
            ("Muon, deepseek-v3 dp_replicate2 x dp_shard2 x tp2, ep4",
             ["--mesh", "2x2x2", "--ep", "4"], moe_flags)):
        got = run(8, one + muon + extra, 3)
        muon_runs.append(got)
        ok = check_first_steps(label, got, run(1, one + muon, 3)) and len(got) == 3 and ok
    resumed = run(4, muon + ["--mesh", "1x4x1", "--resume", os.path.join(muon_ckpt, "step-2"),
                             "--lr-total-steps", "3"], 3)
    want = muon_runs[0][2]["loss"]
    close = [r["step"] for r in resumed] == [2] and abs(resumed[0]["loss"] - want) <= 1e-4 * want
    print(f"Muon resumed on dp_shard 4, step 2: loss {resumed[0]['loss']:.6f} against the pp "
          f"run's {want:.6f}{'' if close else '  FAIL'}")
    ok = ok and close
    # The MoE model under fully_shard's mixed precision (bf16 parameters, fp32 reductions; the
    # router's gate upcast to fp32 from the unsharded bf16 weight): 8 ranks against 1.
    bf16 = [f for f in moe_flags] + ["--precision", "bf16"]
    moe_bf16_1 = run(1, bf16, 3)
    moe_bf16_8 = run(8, bf16 + ["--mesh", "1x4x2", "--ep", "4"], 3)
    for a, b in zip(moe_bf16_8, moe_bf16_1):
        close = abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"])
        print(f"deepseek-v3 bf16, dp_shard4 x tp2 ep4, step {a['step']}: loss {a['loss']:.5f} "
              f"against one rank's {b['loss']:.5f}{'' if close else '  FAIL'}")
        ok = ok and close and len(moe_bf16_8) == 3
    # Resumed on another mesh: the same next batches, token for token.
    pp = runs[layouts[0][0]]
    # Stopped at 23, with the learning-rate schedule of the 40-step run it continues.
    resumed = run(4, ["--mesh", "1x4x1", "--resume", os.path.join(ckpt, "step-20"),
                      "--lr-total-steps", str(STEPS)], 23)
    want = [r for r in pp if 20 <= r["step"] < 23]
    if [r["step"] for r in resumed] != [20, 21, 22]:
        print(f"FAIL resumed steps {[r['step'] for r in resumed]}")
        ok = False
    for a, b in zip(resumed, want):
        same = a["batch_digest"] == b["batch_digest"] and a["data_position"] == b["data_position"]
        close = abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"])
        print(f"resumed on dp_shard 4, step {a['step']}: position {a['data_position']}, loss "
              f"{a['loss']:.6f} against {b['loss']:.6f}{'' if same and close else '  FAIL'}")
        ok = ok and same and close
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
