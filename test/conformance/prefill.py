"""Fills the oracle cache for the conformance tests of a build, one torchrun per world size.

  prefill.py BUILDDIR [--suite world1 --suite world2 ...]

[Note: the oracle's batch]
Each conformance test (run.py) runs PyTorch's side of its scenario under its own torchrun
when the oracle cache has no records for it ([Note: the oracle cache] in run.py). On a new
machine that is 38 launches, and each pays the same start before its first case: torchrun and
every rank import torch and build a process group (7.5 s for the smallest scenario on one
rank, 11 s on four, on two cores). This script runs, before the suites, every scenario whose
records are missing, in one torchrun per world size: the same oracle.py, the same cases.pt
and ref.pt that run.py would write, the scenarios in turn in one process group, each into its
own directory, and keeps each scenario's records in the cache under run.py's own key. The
tests then find them there. The judge is unchanged (PyTorch on the same cases; each scenario
builds its own meshes and seeds its own cases); a scenario whose batch did not finish on every
rank is not kept, and its test runs PyTorch itself as before. The scenarios and worlds are the
build's own conformance tests (meson introspect), so the list has one home: test/conformance/
meson.build.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import run  # noqa: E402


def conformance_tests(builddir, suites):
    """(scenario, world) of each conformance test of the build, in the given suites."""
    meson = os.path.join(os.path.dirname(sys.executable), "meson")
    tests = json.loads(subprocess.run([meson, "introspect", "--tests", builddir],
                                      check=True, capture_output=True, text=True).stdout)
    found = []
    for t in tests:
        mine = {x.split(":")[-1] for x in t["suite"]}  # "dtensor:world2" -> "world2"
        if "conformance" not in mine or (suites and not set(suites) & mine):
            continue
        cmd = t["cmd"]
        at = next(i for i, a in enumerate(cmd) if a.endswith("run.py"))
        found.append((cmd[at + 1], int(cmd[at + 2])))
    return found


def prepare(scenario, world, tmp):
    """run.py's first step: cases.pt and ref.pt in a directory of its own; None when the
    cache already has this key's records."""
    out = os.path.join(tmp, f"{scenario}-w{world}")
    os.makedirs(out)
    mod = __import__("sc_" + scenario)
    cases = mod.cases(world)
    torch.save(cases, os.path.join(out, "cases.pt"))
    if os.environ.get("DTENSOR_ORACLE_RERUN") != "1" and os.path.isfile(
            os.path.join(run.oracle_cache_dir(scenario, world, out), "complete")):
        return None
    torch.save(mod.reference(cases), os.path.join(out, "ref.pt"))
    return out


def prefill_world(world, scenarios, tmp):
    todo = [(s, out) for s in scenarios if (out := prepare(s, world, tmp))]
    if not todo:
        return 0
    argv = [os.path.join(HERE, "oracle.py")] + [x for pair in todo for x in pair]
    log = os.path.join(tmp, f"batch-w{world}.log")
    rc, secs = run.launch(world, argv, 300 + 120 * len(todo), log)
    kept = 0
    for scenario, out in todo:
        if os.path.isfile(os.path.join(out, "torch", "done")):
            shutil.copy(log, os.path.join(out, "torch.log"))
            run.oracle_to_cache(scenario, world, out)
            kept += 1
    print(f"[prefill] w{world}: {kept} of {len(todo)} scenarios' PyTorch records kept "
          f"(torchrun exit {rc} in {secs:.1f} s)", flush=True)
    if rc != 0:
        print(open(log).read()[-3000:])
    return len(todo) - kept


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("builddir")
    ap.add_argument("--suite", action="append", default=[])
    args = ap.parse_args()
    by_world = {}
    for scenario, world in conformance_tests(args.builddir, args.suite):
        by_world.setdefault(world, []).append(scenario)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="oracle-prefill-") as tmp:
        missed = sum(prefill_world(w, ss, tmp) for w, ss in sorted(by_world.items()))
    print(f"[prefill] done in {time.time() - t0:.0f} s"
          + (f"; {missed} left to their tests" if missed else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
