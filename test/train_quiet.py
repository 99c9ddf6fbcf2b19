#!/usr/bin/env python3
"""The main job stays quiet and learns (meson test train_llama-w8).

usage: train_quiet.py TORCHRUN TRAIN NPROC [TRAIN FLAGS...]
Runs the trainer as scripts/demo.sh does; passes when it exits 0 (it does only when the loss
falls), its output is only its own lines (the header, the step table, the sample and the
summary, and the line saying what data it reads: no warnings, no Gloo connection lines, nothing on stderr), and the metrics file has
one JSON object per step with the documented keys.
"""
import json
import os
import re
import subprocess
import sys

OWN = [r"dtensor train \(Llama 3 recipe\): ", r"data: ", r" step +loss +tokens/s",
       r" +\d+ +\d+\.\d{4} ",
       r"sample: \"", r"loss \d+\.\d+ -> \d+\.\d+ \(falling\)"]
KEYS = {"step", "loss", "tokens_per_s", "tokens_per_s_per_device", "tokens_seen", "grad_norm",
        "step_s", "peak_resident_mib", "max_live_tensor_mib", "collectives", "collective_bytes", "collectives_by_group",
        "batch_digest", "lr", "flops_per_token", "tflops_per_device"}


def main():
    torchrun, train, nproc, *flags = sys.argv[1:]
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="WARNING", PYTHONWARNINGS="ignore::UserWarning")
    p = subprocess.run([torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python",
                        train, *flags], capture_output=True, text=True, timeout=280, env=env)
    print(p.stdout)
    # torchrun's own logging (its launcher process, not the job) is not the job's output.
    stderr = [l for l in p.stderr.splitlines() if l.strip() and not re.match(r"[WI]\d{4} ", l)]
    stray = [l for l in p.stdout.splitlines() if l.strip() and not any(re.match(o, l) for o in OWN)]
    ok = p.returncode == 0 and not stderr and not stray
    metrics = flags[flags.index("--metrics") + 1]
    rows = [json.loads(l) for l in open(metrics)]
    steps = int(flags[flags.index("--steps") + 1])
    ok = ok and [r["step"] for r in rows] == list(range(steps)) and all(set(r) == KEYS for r in rows)
    if not ok:
        print(f"exit {p.returncode}; stray stdout lines: {stray[:5]}; stderr: {stderr[:10]}; "
              f"metrics rows {len(rows)}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
