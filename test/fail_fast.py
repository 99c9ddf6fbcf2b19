#!/usr/bin/env python3
"""A rank that throws, or one that stalls, must make the whole job fail within the timeout.

usage: fail_fast.py TORCHRUN WORKER TEST_PROGRAM NPROC
Runs WORKER under torchrun in five modes (throw and stall: a collective; pipe-throw and
pipe-stall: a pipeline schedule whose last stage fails or stalls mid-step; reshard-kill: a
source rank of a reshard killed, the others' targets left as they were), and
TEST_PROGRAM's hidden test case that fails an assertion on rank 1 only; checks the exit
status, the time it took and the messages (a pipeline's name the rank, stage and action).
Exits 0 when all six behave.
"""
import concurrent.futures
import subprocess
import sys
import time

COLLECTIVE_TIMEOUT_S = 5
LIMIT_S = 60  # generous: torchrun start-up plus one collective timeout


def run(torchrun, worker, nproc, mode):
    """(ok, what it has to say): the five jobs run at once, each reporting when done."""
    lines = []
    say = lines.append  # the jobs' reports, printed in order by main
    if mode == "assertion":
        cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python",
               worker, "[harness-self-check]"]
    else:
        cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python",
               worker, mode, str(COLLECTIVE_TIMEOUT_S)]
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S * 2)
    except subprocess.TimeoutExpired:
        say(f"FAIL {mode}: job still running after {LIMIT_S * 2} s (a rank hangs)")
        return False, lines
    elapsed = time.monotonic() - start
    out = p.stdout + p.stderr
    ok = True
    if p.returncode == 0:
        say(f"FAIL {mode}: torchrun exited 0")
        ok = False
    if elapsed > LIMIT_S:
        say(f"FAIL {mode}: took {elapsed:.1f} s > {LIMIT_S} s")
        ok = False
    last = nproc - 1
    want = {
        "throw": ["rank 1 fails on purpose"],
        # The failing stage's own error names its action; under pipe-stall the previous stage
        # times out in the action that waits for the stalled stage's gradient.
        "pipe-throw": [f"pipeline rank {last} (pp: ranks", f"action {last}F2",
                       f"stage {last} fails on purpose"],
        "pipe-stall": [f"pipeline rank {last - 1} (pp: ranks", f"action {last - 1}B2"],
        "stall": ["rank 0 error:", "all_reduce(sum, Float[4] on cpu) on group dp"],
        "reshard-kill": ["rank 0: reshard failed, targets untouched", "rank 0 error:"],
        "assertion": ["'harness self-check: fails on rank 1 only' failed on rank(s) 1",
                      "failed: rank() != 1"],
    }[mode]
    for w in want:
        if w not in out:
            say(f"FAIL {mode}: output lacks {w!r}")
            ok = False
    if "completed without" in out or "HALF-WRITTEN" in out:
        say(f"FAIL {mode}: a collective completed without rank 1, or a target half-written")
        ok = False
    say(f"{'ok' if ok else 'FAIL'} {mode}: exit {p.returncode} after {elapsed:.1f} s")
    if not ok:
        say(out[-4000:])
    return ok, lines


def main():
    torchrun, worker, test_program, nproc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    jobs = [(worker, m) for m in ("throw", "stall", "pipe-throw", "pipe-stall", "reshard-kill")]
    jobs.append((test_program, "assertion"))
    # At once: each job spends most of its time waiting for a timeout or a start-up, and each
    # is its own torchrun (its own store on a free port); the limits hold under the load.
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: run(torchrun, j[0], nproc, j[1]), jobs))
    for _, lines in results:
        print("\n".join(lines))
    sys.exit(0 if all(ok for ok, _ in results) else 1)


if __name__ == "__main__":
    main()
