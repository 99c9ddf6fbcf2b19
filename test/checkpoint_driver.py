#!/usr/bin/env python3
"""Checkpoint tests that span several jobs (meson tests checkpoint_resume / _kill / _interop).

usage: checkpoint_driver.py resume|kill|interop|train|disk TORCHRUN WORKER TORCH_SCRIPT [TRAIN]
  resume   worker resume a (4 ranks, dp=2 x tp=2), b (2 ranks, FSDP), c (1 rank, plain):
           each resumed run's losses and final parameters equal the uninterrupted run's.
  kill     a checkpoint saved on 4 ranks; a second save on 4 ranks with rank 2 killed
           (_exit) after writing its file must fail the job; then 2 ranks load the first
           checkpoint intact and a new save replaces it.
  interop  dtensor writes on 4 ranks, PyTorch (FSDP2) loads on 2 ranks; PyTorch writes on 2
           ranks, dtensor loads on 4 ranks: every tensor equal.
  train    the main job (examples/train) saves every 5 steps on 4 ranks (dp=2, tp=2) into
           step-<N> subdirectories, keeping the newest, and resumes on 2 ranks (dp=1, tp=2)
           at step 10; its --save into a folder of the user's files is refused, untouched.
  disk     a save on a full disk and on a read-only file system (a tmpfs in a private mount
           namespace) fails on every rank; the previous checkpoint still loads.
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


def train_mode(torchrun, work, train):
    """The recipe's checkpoint folder: step-<N> per save, the newest kept, resumed from it;
    a folder holding anything else is refused before training, untouched."""
    ckpt = os.path.join(work, "train")
    flags = ["--no-python"] + train + ["--metrics", os.path.join(work, "metrics.jsonl")]
    good, out = job(torchrun, 4, flags + ["--steps", "15", "--save", ckpt, "--save-every", "5",
                                          "--keep-latest", "2"])
    step = lambda n: os.path.join(ckpt, f"step-{n}")
    ok = good and f"saved step 5 to {step(5)} " in out and f"saved step 15 to {step(15)} " in out
    left = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else None
    if left != ["step-10", "step-15"]:
        print(f"FAIL: --keep-latest 2 left {left}, not ['step-10', 'step-15']")
        ok = False
    good, out = job(torchrun, 2, flags + ["--steps", "17", "--resume", ckpt])
    ok = ok and good and f"resumed from {step(15)} at step 15" in out and "   16 " in out
    # --save into a directory holding the user's files: refused on every rank, untouched.
    mine = os.path.join(work, "mine")
    os.makedirs(os.path.join(mine, "configs"))
    with open(os.path.join(mine, "notes.txt"), "w") as f:
        f.write("notes")
    good, out = job(torchrun, 2, flags + ["--steps", "2", "--save", mine], expect_ok=False)
    refused = f"--save {mine}: it holds entries this recipe did not write (configs, notes.txt)"
    # Every rank raises it (agreed: test_checkpoint_targets asserts that); torchrun may stop
    # the second before it prints.
    ok = ok and good and refused in out
    if sorted(os.listdir(mine)) != ["configs", "notes.txt"] or open(os.path.join(mine, "notes.txt")).read() != "notes":
        print(f"FAIL: the refused --save changed {mine}: {os.listdir(mine)}")
        ok = False
    if not ok:
        print(out[-3000:])
    return ok


def disk(torchrun, cpp, work):
    """A save on a full disk and on a read-only file system: every rank raises, the previous
    checkpoint still loads, nothing is left behind. Runs in a private mount namespace with a
    small tmpfs (unshare, as root or in a user namespace); where the machine allows neither,
    the write failure is the kernel's for a file-size limit (RLIMIT_FSIZE), said so."""
    if os.environ.get("DTENSOR_DISK_NS") != "1":
        for prefix in (["unshare", "--mount", "--propagation", "private"],
                       ["unshare", "--map-root-user", "--mount", "--propagation", "private"]):
            if subprocess.run(prefix + ["true"], capture_output=True).returncode == 0:
                p = subprocess.run(prefix + [sys.executable] + sys.argv,
                                   env=dict(os.environ, DTENSOR_DISK_NS="1"))
                return p.returncode == 0
        print("no mount namespace here (unshare refused): the full disk is RLIMIT_FSIZE's EFBIG")
        ok = job(torchrun, 2, cpp + ["disk-setup", work])[0]
        return job(torchrun, 2, cpp + ["disk-fail", work, "File too large"],
                   env={"DTENSOR_TEST_FSIZE_LIMIT": str(256 * 1024)})[0] and ok
    fs = os.path.join(work, "fs")
    os.makedirs(fs)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", fs], check=True)
    try:
        ok = job(torchrun, 2, cpp + ["disk-setup", fs])[0]
        ok = job(torchrun, 2, cpp + ["disk-fail", fs, "No space left on device"])[0] and ok
        subprocess.run(["mount", "-o", "remount,ro", fs], check=True)
        ok = job(torchrun, 2, cpp + ["disk-fail", fs, "Read-only file system"])[0] and ok
    finally:
        subprocess.run(["umount", fs])
    return ok


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
            if left != [".dtensor-manifest.json"] + [f"shard-{r:05d}-model-00001-of-00001.safetensors" for r in (1, 2, 3, 4)]:
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
            ok = train_mode(torchrun, work, sys.argv[5:6])
        elif mode == "disk":
            ok = disk(torchrun, cpp, work)
        else:
            print(f"unknown mode {mode}")
            ok = False
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("checkpoint_driver", mode, "passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
