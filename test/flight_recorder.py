#!/usr/bin/env python3
"""The flight recorder: when a 4-rank job goes wrong, every rank writes its record and
fr_trace names the rank and the collective where the ranks diverged.

usage: flight_recorder.py TORCHRUN WORKER FR_TRACE OUT_DIR
Runs WORKER (test/flight_recorder_worker.cpp) in three modes at once: the last rank skips a
collective (the others time out), calls another one (the agreement on sizes finds it), calls
another one with the agreement off (Gloo fails or times out). Each job must fail within the
limit, leave rank_0..3.json (records that parse, with the scenario's collectives in them),
and fr_trace's verdict must name the last rank and the place. Exits 0 when all three do.
"""
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time

NPROC = 4
TIMEOUT_S = 5
LIMIT_S = 60  # torchrun start-up, one collective timeout, torchrun's stop of the rest

# What fr_trace must say, per mode. The last rank's 4th call of 5: with the agreement on,
# every call is two collectives (the agreement's all-gather, then the call itself).
WANT = {
    # Skipped: its 4 calls are #0-#7; the others' 5th call (#8, its agreement) has no peer.
    "skip": ["collective #8: rank 3 never issued it",
             "ranks 0, 1, 2 issued the agreement on sizes for all_reduce(sum, Float[4] on cpu)"],
    "mismatch": ["collective #6: the ranks issued different collectives",
                 "ranks 0, 1, 2 issued the agreement on sizes for all_reduce",
                 "rank 3 issued the agreement on sizes for all_gather_into_tensor"],
    "mismatch-raw": ["collective #3: ", "rank 3 issued all_gather_into_tensor(Float[4] on cpu)",
                     "ranks 0, 1, 2 issued all_reduce(sum, Float[4] on cpu)"],
}


def run(torchrun, worker, fr_trace, out, mode):
    lines = []
    folder = os.path.join(out, mode)
    shutil.rmtree(folder, ignore_errors=True)
    env = dict(os.environ, DTENSOR_FLIGHT_RECORDER_DIR=folder, OMP_NUM_THREADS="1")
    if mode == "mismatch-raw":
        env["DTENSOR_AGREE_SIZES"] = "0"
    cmd = [torchrun, "--standalone", f"--nproc-per-node={NPROC}", "--no-python", worker, mode,
           str(TIMEOUT_S)]
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S * 2, env=env)
    except subprocess.TimeoutExpired:
        return False, [f"FAIL {mode}: still running after {LIMIT_S * 2} s (a rank hangs)"]
    elapsed = time.monotonic() - start
    ok = True
    if p.returncode == 0:
        lines.append(f"FAIL {mode}: torchrun exited 0")
        ok = False
    if elapsed > LIMIT_S:
        lines.append(f"FAIL {mode}: took {elapsed:.1f} s > {LIMIT_S} s")
        ok = False
    for r in range(NPROC):
        path = os.path.join(folder, f"rank_{r}.json")
        if not os.path.exists(path):
            lines.append(f"FAIL {mode}: no record from rank {r}")
            ok = False
            continue
        rec = json.load(open(path))
        ops = [e["op"] for e in rec["entries"] if not e["agreeing_on"]]
        # The calls this rank made before the trouble, as the worker makes them.
        want_ops = ["all_reduce"] * 3
        if ops[:3] != want_ops or rec["rank"] != r or rec["world_size"] != NPROC:
            lines.append(f"FAIL {mode}: rank {r}'s record holds {ops} (rank {rec['rank']})")
            ok = False
        lines.append(f"  {mode} rank {r}: {len(rec['entries'])} entries; reason: "
                     f"{rec['reason'][:160]}")
    v = subprocess.run([fr_trace, folder], capture_output=True, text=True, timeout=60)
    lines.append(f"  fr_trace {mode} (exit {v.returncode}):")
    lines += ["    " + l for l in v.stdout.splitlines()]
    for w in WANT[mode]:
        if w not in v.stdout:
            lines.append(f"FAIL {mode}: fr_trace's output lacks {w!r}")
            ok = False
    lines.append(f"{'ok' if ok else 'FAIL'} {mode}: exit {p.returncode} after {elapsed:.1f} s")
    if not ok:
        lines.append(p.stderr[-3000:])
    return ok, lines


def main():
    torchrun, worker, fr_trace, out = sys.argv[1:]
    os.makedirs(out, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(len(WANT)) as pool:
        results = list(pool.map(lambda m: run(torchrun, worker, fr_trace, out, m), WANT))
    for _, lines in results:
        print("\n".join(lines))
    sys.exit(0 if all(ok for ok, _ in results) else 1)


if __name__ == "__main__":
    main()
