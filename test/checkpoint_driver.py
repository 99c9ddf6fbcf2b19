#!/usr/bin/env python3
"""Checkpoint tests that span several jobs (meson tests checkpoint_resume / _kill / _interop).

usage: checkpoint_driver.py resume|kill|interop|train TORCHRUN WORKER TORCH_SCRIPT [TRAIN]
  resume   worker resume a (4 ranks, dp=2 x tp=2), b (2 ranks, FSDP), c (1 rank, plain):
           each resumed run's losses and final parameters equal the uninterrupted run's.
  kill     a checkpoint saved on 4 ranks; a second save on 4 ranks with rank 2 killed
           (_exit) after writing its file must fail the job; then 2 ranks load the first
           checkpoint intact and a new save replaces it.
  interop  dtensor writes on 4 ranks, PyTorch (FSDP2) loads on 2 ranks; PyTorch writes on 2
           ranks, dtensor loads on 4 ranks: every tensor equal.
  train    the main job (examples/train) saves every 5 steps on 4 ranks (dp=2, tp=2) and
           resumes on 2 ranks (dp=1, tp=2) at step 10.
Exits 0 when every job behaves.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

LIMIT_S = 120


def job(torchrun, nproc, argv, env=None, expect_ok=True):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}"] + argv
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S * 2,
                       env=dict(os.environ, **(env or {})))
    took = time.monotonic() - start
    out = p.stdout + p.stderr
    good = (p.returncode == 0) == expect_ok and took < LIMIT_S
    print(f"{'ok' if good else 'FAIL'}: {' '.join(argv[-3:])} on {nproc} ranks: exit {p.returncode} "
          f"after {took:.1f} s (expected {'success' if expect_ok else 'failure'})")
    if not good or os.environ.get("CHECKPOINT_DRIVER_VERBOSE"):
        print(out[-6000:])
    return good, out


def main():
    mode, torchrun, worker, script = sys.argv[1:5]
    cpp = ["--no-python", worker]
    work = tempfile.mkdtemp(prefix=f"dtensor-checkpoint-{mode}-")
    ok = True
    try:
        if mode == "resume":
            for phase, nproc in (("a", 4), ("b", 2), ("c", 1)):
                ok = job(torchrun, nproc, cpp + ["resume", phase, work])[0] and ok
        elif mode == "kill":
            ok = job(torchrun, 4, cpp + ["kill-setup", work])[0]
            good, out = job(torchrun, 4, cpp + ["kill-save", work],
                            env={"DTENSOR_CHECKPOINT_FAULT": "2:exit"}, expect_ok=False)
            ok = ok and good
            if "exitcode  : 17" not in out:
                print("FAIL: rank 2 did not die with the injected exit code 17")
                ok = False
            ckpt = os.path.join(work, "ckpt")
            left = sorted(os.listdir(ckpt))
            if left != [f"shard-{r:05d}-model-00001-of-00001.safetensors" for r in (1, 2, 3, 4)]:
                print(f"FAIL: the visible checkpoint changed: {left}")
                ok = False
            if not os.path.isdir(os.path.join(work, ".ckpt.dtensor-tmp")):
                print("FAIL: the killed save left no temporary directory (was it written in place?)")
                ok = False
            ok = job(torchrun, 2, cpp + ["kill-verify", work])[0] and ok
        elif mode == "interop":
            ok = job(torchrun, 4, cpp + ["interop-write", work])[0]
            ok = job(torchrun, 2, [script, "read", work])[0] and ok
            ok = job(torchrun, 2, [script, "write", work])[0] and ok
            ok = job(torchrun, 4, cpp + ["interop-read", work])[0] and ok
        elif mode == "train":
            ckpt = os.path.join(work, "train")
            train = [sys.argv[5]] if len(sys.argv) > 5 else []
            good, out = job(torchrun, 4, ["--no-python"] + train + ["--steps", "10", "--save", ckpt,
                                                                      "--save-every", "5"])
            ok = good and f"saved step 5 to {ckpt}" in out and f"saved step 10 to {ckpt}" in out
            good, out = job(torchrun, 2, ["--no-python"] + train + ["--steps", "14", "--resume", ckpt])
            ok = ok and good and f"resumed from {ckpt} at step 10" in out and "   13 " in out
            if not ok:
                print(out[-3000:])
        else:
            print(f"unknown mode {mode}")
            ok = False
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("checkpoint_driver", mode, "passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
