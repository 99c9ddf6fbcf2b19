#!/usr/bin/env python3
"""Runs one test program as N ranks on this machine: launch.py N PROGRAM [ARGS...]

The ranks get torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT on a free port), so dtensor::init_process_group finds
its world as under `torchrun --standalone --no-python`; rank 0 serves the TCPStore (no agent
store). Like torchrun, the first rank to fail stops the others (SIGTERM, then SIGKILL) and
its exit status is the launcher's; a signal that stops the launcher stops the ranks.

[Note: the test launcher] torchrun imports torch before it starts a rank: about 3.3 CPU
seconds on a 2-core machine, most of a small test's cost and about 9 CPU-minutes of the
suites' time. The Catch2 programs and dtensor's side of the conformance suite run under this
launcher (Python without torch: milliseconds); torchrun stays the launcher where launching is
what is used or tested (the demo, the recipe and its fault and resume drivers, fail_fast, the
checkpoint drivers, the Hugging Face exchange, PyTorch's side of the conformance suite) and
of test_mesh_groups, which joins torchrun's agent store.
"""
import os
import signal
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(procs, grace_s=5.0):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main():
    if len(sys.argv) < 3 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 1:
        sys.exit("usage: launch.py N PROGRAM [ARGS...] (N >= 1 ranks)")
    n, cmd = int(sys.argv[1]), sys.argv[2:]
    port = str(free_port())
    procs = []

    def on_signal(signum, _frame):
        stop(procs)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0", ROLE_RANK=str(r),
                   WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), ROLE_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen(cmd, env=env))
    status = 0
    running = set(range(n))
    while running:
        pid, raw = os.wait()
        rank = next((r for r in running if procs[r].pid == pid), None)
        if rank is None:
            continue
        running.discard(rank)
        procs[rank].returncode = os.waitstatus_to_exitcode(raw)
        code = procs[rank].returncode
        if code != 0:
            status = code if code > 0 else 128 - code
            print(f"[launch] rank {rank} of {n} failed (exit {code}): stopping the others",
                  file=sys.stderr, flush=True)
            stop([procs[r] for r in running])
            break
    sys.exit(status)


if __name__ == "__main__":
    main()
