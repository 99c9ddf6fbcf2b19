#!/usr/bin/env python3
"""The recipe's last save and starting points as torchtitan's checkpointer has them (meson test
last_save-w2): checkpoint.last_save_in_hf / last_save_model_only / export_dtype and
checkpoint.initial_load_path / initial_load_model_only / initial_load_in_hf, with their flags.

usage: last_save_recipe.py TORCHRUN TRAIN OUTDIR
On 2 ranks (dp_shard 2), a small model:
- `--last-save-hf --export-dtype bfloat16` writes the last step as a Hugging Face folder that
  transformers loads in bfloat16, each tensor torch's bfloat16 rounding of the same run's
  float32 `--export-hf` (bit for bit), with the tokenizer's file;
- `--auto-resume` skips that folder (no training state in it) and resumes from the step
  before, its losses those of the first run;
- a model-only last save in bfloat16 (torchtitan's keys) is refused by `--resume`, naming
  `--init-from`; started from with initial_load_path (model only), and a Hugging Face step
  with initial_load_in_hf or `--init-from FOLDER`, the weights exported at step 0 equal the
  judge's rounding of the float32 export;
- last_save_in_hf with last_save_model_only false is refused as torchtitan refuses it.
"""
import os
import shutil
import subprocess
import sys

import torch

from recipe_runs import hf_tensors, launch, run

SMALL = ["--dim", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--seq", "16",
         "--batch", "4", "--vocab", "64", "--precision", "fp32", "--ac", "none",
         "--log-every", "1", "--mesh", "1x2x1", "--lr", "0.03", "--warmup-steps", "0",
         "--lr-total-steps", "6"]


def same_as(label, got_dir, want, convert):
    """Every tensor of the folder `got_dir` equal, bit for bit, to convert(want's)."""
    got = hf_tensors(got_dir)
    bad = [k for k in want if k not in got or got[k].dtype != convert(want[k]).dtype
           or not torch.equal(got[k], convert(want[k]))]
    ok = set(got) == set(want) and not bad
    print(f"{'ok' if ok else 'FAIL'} {label}: {len(got)} tensors, {len(bad)} differ"
          f"{' (' + ', '.join(bad[:3]) + ')' if bad else ''}")
    return ok


def step_zero_export(torchrun, train, out, name, extra):
    """A run of no steps from `extra`'s starting point: its --export-hf folder."""
    folder = os.path.join(out, name)
    run(torchrun, train, 2, out, SMALL, ["--steps", "0", "--export-hf", folder, *extra])
    return folder


def main():
    torchrun, train, out = sys.argv[1:4]
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    d, e = os.path.join(out, "ckpt"), os.path.join(out, "export")
    first, _ = run(torchrun, train, 2, out, SMALL,
                   ["--steps", "6", "--save", d, "--save-every", "3", "--last-save-hf",
                    "--export-dtype", "bfloat16", "--export-hf", e])
    fp32 = hf_tensors(e)
    bf16 = lambda t: t.to(torch.bfloat16)
    back = lambda t: t.to(torch.bfloat16).to(torch.float32)
    last = os.path.join(d, "step-6")
    ok = same_as("--last-save-hf in bfloat16: the float32 export rounded", last, fp32, bf16)
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(last)
    files = sorted(os.listdir(last))
    good = model.dtype == torch.bfloat16 and "tokenizer.model" in files
    print(f"{'ok' if good else 'FAIL'} transformers loads step-6 as {model.dtype}; files {files}")
    ok &= good

    # Starting points from the Hugging Face step, before the resumed run replaces it.
    hf_key = step_zero_export(torchrun, train, out, "from-hf-key",
                              ["--checkpoint.enable", "--checkpoint.folder",
                               os.path.join(out, "empty1"), "--checkpoint.initial_load_path",
                               last, "--checkpoint.initial_load_in_hf"])
    ok &= same_as("initial_load_in_hf from step-6, exported at step 0", hf_key, fp32, back)
    hf_flag = step_zero_export(torchrun, train, out, "from-hf-flag", ["--init-from", d])
    ok &= same_as("--init-from the folder (its newest, a Hugging Face step)", hf_flag, fp32, back)

    resumed, _ = run(torchrun, train, 2, out, SMALL,
                     ["--steps", "6", "--save", d, "--auto-resume"])
    want = [r for r in first if r["step"] >= 3]
    good = ([r["step"] for r in resumed] == [3, 4, 5] and
            all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
                for a, b in zip(resumed, want)))
    print(f"{'ok' if good else 'FAIL'} --auto-resume skips the Hugging Face step-6: steps "
          f"{[r['step'] for r in resumed]}, losses {[r['loss'] for r in resumed]} against "
          f"{[r['loss'] for r in want]}")
    ok &= good

    # torchtitan's keys: a model-only last save in bfloat16, then started from it.
    m, e2 = os.path.join(out, "model-only"), os.path.join(out, "export2")
    run(torchrun, train, 2, out, SMALL,
        ["--steps", "6", "--checkpoint.enable", "--checkpoint.folder", m,
         "--checkpoint.interval", "10", "--checkpoint.last_save_model_only",
         "--checkpoint.export_dtype", "bfloat16", "--export-hf", e2])
    p = launch(torchrun, train, 2, [*SMALL, "--steps", "7", "--resume", os.path.join(m, "step-6")])
    good = p.returncode != 0 and "holds a model only" in p.stderr and "--init-from" in p.stderr
    print(f"{'ok' if good else 'FAIL'} --resume of a model-only save refused: exit "
          f"{p.returncode}")
    ok &= good
    model_only = step_zero_export(torchrun, train, out, "from-model-only",
                                  ["--checkpoint.enable", "--checkpoint.folder",
                                   os.path.join(out, "empty2"), "--checkpoint.initial_load_path",
                                   m])
    ok &= same_as("initial_load_path (model only) of the bfloat16 save", model_only,
                  hf_tensors(e2), back)

    p = subprocess.run([train, *SMALL, "--checkpoint.enable", "--checkpoint.last_save_in_hf",
                        "--checkpoint.last_save_model_only=false"], capture_output=True,
                       text=True, timeout=60)
    good = p.returncode == 2 and "requires last_save_model_only true" in p.stderr
    print(f"{'ok' if good else 'FAIL'} last_save_in_hf without last_save_model_only refused: "
          f"exit {p.returncode}: {p.stderr.strip()[:200]}")
    ok &= good
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
