#!/usr/bin/env python3
"""Runs the threaded multi-rank programs over and over within a time budget, under glibc's
heap checks: stress.py BUILD_DIR BUDGET_S [--tsan] [NAME:WORLD[:FILTER] ...]
--tsan: the build is ThreadSanitizer's (scripts/tsan.sh): its report fails the run, and
glibc's checks stay off (ThreadSanitizer has its own allocator).

[Note: the stress job] A heap corruption that shows once in 80 runs passes any single run of
the suites. This job repeats the programs whose collectives run on Gloo's threads while the
main thread computes (prefetches, background reduce-scatters, asynchronous unshards and saves,
pipelined sends, expert dispatch) with MALLOC_PERTURB_ set (freed memory filled, so a read
after free computes garbage that the tests' value checks catch) and glibc's own tcache and
chunk checks, which abort at the next malloc or free that meets a corrupted chunk. Not
MALLOC_CHECK_: libc_malloc_debug, which glibc 2.34 and later need for it, replaces the
tcache, the very structure whose check ("malloc(): unaligned tcache chunk detected") fires
on a write into a small freed chunk; DTENSOR_STRESS_MALLOC_CHECK=1 adds it anyway. Each run is launched as the suites launch it (launch.py). A failure
prints the run's output and, where a core dump was written, the failing thread's backtrace
(gdb), then the job fails; otherwise it prints the number of runs of each program.
Programs run round-robin until the budget is spent (the last run may end past it).
"""
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = [
    "fsdp_controls:4",
    "fsdp_overlap:2",
    "fsdp_overlap:4",
    "comm_hooks:4",
    "checkpoint:2",
    "pipelining:2",
    "moe:2",
]


def tsan_env():
    supp = os.path.join(HERE, "sanitizer", "tsan.supp")
    return dict(os.environ, OMP_NUM_THREADS="1",
                TSAN_OPTIONS=f"halt_on_error=1:abort_on_error=1:detect_deadlocks=0:"
                             f"report_signal_unsafe=0:suppressions={supp}")


def heap_check_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_PERTURB_="165")
    debug = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
    if os.environ.get("DTENSOR_STRESS_MALLOC_CHECK") == "1" and os.path.exists(debug):
        env["MALLOC_CHECK_"] = "3"  # glibc >= 2.34 reads it only with the debug library
        env["LD_PRELOAD"] = debug
    return env


def backtraces(program, cwd):
    out = []
    for name in sorted(os.listdir(cwd)):
        if name.startswith("core"):
            bt = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt 30", program,
                                 os.path.join(cwd, name)],
                                capture_output=True, text=True, timeout=300)
            out.append(f"--- {name}\n{bt.stdout[-20000:]}")
    return "\n".join(out)


def core_dumps_on():
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def run_once(build, entry, env):
    name, world, *rest = entry.split(":")
    program = os.path.join(build, "test", "test_" + name)
    cmd = [sys.executable, os.path.join(HERE, "launch.py"), world, program] + rest
    with tempfile.TemporaryDirectory(prefix="stress-") as cwd:
        start = time.monotonic()
        # Core dumps on: a crash leaves its threads' backtraces for backtraces() to print.
        try:
            p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=600, preexec_fn=core_dumps_on)
        except subprocess.TimeoutExpired as e:  # a hang is a failure too
            print(f"[stress] {entry} FAILED: still running after 600 s")
            for out in (e.stdout, e.stderr):  # str or bytes, by Python version
                out = out or ""
                print((out.decode(errors="replace") if isinstance(out, bytes) else out)[-20000:])
            return False, time.monotonic() - start
        seconds = time.monotonic() - start
        if p.returncode != 0:
            print(f"[stress] {entry} FAILED (exit {p.returncode}) after {seconds:.1f} s")
            print(p.stdout[-20000:])
            print(p.stderr[-20000:])
            print(backtraces(program, cwd))
            return False, seconds
    return True, seconds


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    build, budget = os.path.abspath(sys.argv[1]), float(sys.argv[2])
    rest = sys.argv[3:]
    tsan = "--tsan" in rest
    entries = [e for e in rest if e != "--tsan"] or DEFAULT
    env = tsan_env() if tsan else heap_check_env()
    runs = {e: 0 for e in entries}
    spent = {e: 0.0 for e in entries}
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < budget:
        e = entries[i % len(entries)]
        ok, seconds = run_once(build, e, env)
        runs[e] += 1
        spent[e] += seconds
        if not ok:
            sys.exit(1)
        i += 1
    summary = ", ".join(f"{e} x{runs[e]} ({spent[e]:.0f} s)" for e in entries)
    print(f"[stress] {sum(runs.values())} runs in {time.monotonic() - start:.0f} s, no failure: "
          f"{summary}")


if __name__ == "__main__":
    main()
