#!/usr/bin/env python3
"""The recipe's TOML job files (meson test config_recipe).

usage: config_recipe.py TORCHRUN TRAIN CONFIGS OUTDIR
- configs/debug_model.toml with --steps 3 --tp 2 --dp-replicate 1 on 2 ranks, and the same run
  spelled as flags only (--mesh 1x1x2 and every key's flag): every step's loss and gradient
  norm equal, bit for bit, and the same collectives (the file and the flags are one run).
- Refusals, each naming the file and the key, before anything runs (exit 2): an unknown key
  (with the section's known keys), a value of the wrong type, a value outside the flag's
  choices, a TOML syntax error (with its line).
"""
import os
import subprocess
import sys

from recipe_runs import run as run_recipe

FLAGS = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "128",
         "--lr", "3e-3", "--seq", "32", "--batch", "32", "--max-norm", "1.0",
         "--precision", "bf16", "--ac", "full", "--log-every", "1"]


def refused(train, out, name, text, wants, extra=()):
    path = os.path.join(out, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    p = subprocess.run([train, "--config", path, *extra], capture_output=True, text=True,
                       timeout=60)
    ok = p.returncode == 2 and all(w in p.stderr for w in wants)
    print(f"{'ok' if ok else 'FAIL'} {name}: exit {p.returncode}: {p.stderr.splitlines()[:1]}")
    return ok


def main():
    torchrun, train, configs, out = sys.argv[1:5]
    os.makedirs(out, exist_ok=True)
    debug = os.path.join(configs, "debug_model.toml")
    steps = ["--steps", "3"]
    a = run_recipe(torchrun, train, 2, out, ["--config", debug, "--tp", "2", "--dp-replicate",
                                             "1", "--log-every", "1"], steps)[0]
    b = run_recipe(torchrun, train, 2, out, FLAGS + ["--mesh", "1x1x2"], steps)[0]
    same = len(a) == len(b) == 3 and all(
        x[k] == y[k] for x, y in zip(a, b) for k in ("loss", "grad_norm", "collectives"))
    print(f"{'ok' if same else 'FAIL'} file and flags: losses {[r['loss'] for r in a]} "
          f"against {[r['loss'] for r in b]}")
    ok = same
    ok &= refused(train, out, "unknown_key", "[training]\nstepz = 3\n",
                  ["unknown_key.toml: training.stepz: unknown key", "training.steps"])
    ok &= refused(train, out, "wrong_type", "[training]\nsteps = \"three\"\n",
                  ["training.steps: expected an integer, got a string"])
    ok &= refused(train, out, "bad_choice", "[activation_checkpoint]\nmode = \"half\"\n",
                  ["activation_checkpoint.mode", "--ac takes full|selective|none"])
    ok &= refused(train, out, "bad_precision", "[training]\nmixed_precision_param = \"fp8\"\n",
                  ["training.mixed_precision_param: \"fp8\" is not one of \"bfloat16\""])
    ok &= refused(train, out, "syntax", "[training]\nsteps = = 3\n", ["syntax.toml:2:"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
