#!/usr/bin/env python3
"""The Llama 3 recipe across jobs (meson tests recipe_resume, recipe_fault).

usage: recipe_driver.py resume|fault TORCHRUN TRAIN
  resume  8 ranks (2x2x2) train 6 steps and save; 4 ranks (1x2x2) resume to step 12: every
          loss equals the uninterrupted 8-rank run's (fp32; within 1e-4 after the change of
          layout, exactly before it).
  fault   8 ranks under torchrun --max-restarts 1 save every 10 steps in the background
          (--async-save --auto-resume); one rank is killed (SIGKILL) at a random moment
          after the second save began: the job finishes, resumed from its last complete
          checkpoint, and every step's loss equals the uninterrupted run's.
Exits 0 when all hold.
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ENV = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="WARNING",
           PYTHONWARNINGS="ignore::UserWarning")


def run(torchrun, nproc, train, *flags, restarts=0):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
           "--no-python", train, *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=ENV)
    if p.returncode != 0:
        print((p.stdout + p.stderr)[-5000:])
        raise SystemExit(f"FAIL: {' '.join(flags)} on {nproc} ranks exited {p.returncode}")
    return p.stdout


def losses(path):
    """The last loss logged for each step (a restarted job logs some steps twice)."""
    out = {}
    for line in open(path):
        row = json.loads(line)
        out[row["step"]] = row["loss"]
    return out


def compare(what, got, want, steps, tol):
    worst = max(abs(got[s] - want[s]) for s in steps)
    ok = sorted(got) == sorted(want) and worst <= tol
    print(f"{'ok' if ok else 'FAIL'}: {what}: steps {steps[0]}..{steps[-1]}, largest loss "
          f"difference {worst:.3g} (tolerance {tol:g})")
    return ok


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def resume(torchrun, train, tmp):
    # The 6-step run and the 12-step runs share one learning-rate schedule, of 12 steps.
    base = ["--precision", "fp32", "--log-every", "100", "--lr-total-steps", "12"]
    ref, out, ckpt = (os.path.join(tmp, n) for n in ("ref.jsonl", "out.jsonl", "ckpt"))
    run(torchrun, 8, train, "--mesh", "2x2x2", "--steps", "12", "--metrics", ref, *base)
    run(torchrun, 8, train, "--mesh", "2x2x2", "--steps", "6", "--save", ckpt, "--metrics", out, *base)
    text = run(torchrun, 4, train, "--mesh", "1x2x2", "--steps", "12", "--resume", ckpt,
               "--metrics", out, *base)
    ok = f"resumed from {os.path.join(ckpt, 'step-6')} at step 6" in text  # the folder's newest
    got, want = losses(out), losses(ref)
    ok &= compare("2x2x2 before the save", got, want, list(range(6)), 0.0)
    ok &= compare("resumed on 1x2x2", got, want, list(range(6, 12)), 1e-4)
    return ok


def fault(torchrun, train, tmp):
    ref, out, ckpt = (os.path.join(tmp, n) for n in ("ref.jsonl", "out.jsonl", "ckpt"))
    flags = ["--steps", "40", "--log-every", "100", "--save-every", "10", "--async-save"]
    run(torchrun, 8, train, *flags, "--save", os.path.join(tmp, "ref-ckpt"), "--metrics", ref)
    cmd = [torchrun, "--standalone", "--nproc-per-node=8", "--max-restarts=1", "--no-python",
           train, *flags, "--save", ckpt, "--auto-resume", "--metrics", out]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    text, killed = [], None
    rng = random.Random()
    for line in p.stdout:
        text.append(line)
        if killed is None and line.startswith("saving step 20"):
            time.sleep(rng.uniform(0.0, 1.0))
            workers = children(p.pid)
            killed = rng.choice(workers)
            os.kill(killed, signal.SIGKILL)
            print(f"killed worker pid {killed} (of {len(workers)}) after the save of step 20 began")
    p.wait(timeout=280)
    text = "".join(text)
    ok = p.returncode == 0 and killed is not None and "resumed from" in text
    if not ok:
        print(text[-5000:])
        print(f"FAIL: exit {p.returncode}, killed {killed}")
    got, want = losses(out), losses(ref)
    return compare("killed and restarted", got, want, list(range(40)), 1e-6) and ok


def main():
    mode, torchrun, train = sys.argv[1:4]
    with tempfile.TemporaryDirectory() as tmp:
        ok = {"resume": resume, "fault": fault}[mode](torchrun, train, tmp)
    print("recipe_driver", mode, "passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
