"""Runs one conformance scenario on N ranks under PyTorch and under dtensor and compares.

  run.py SCENARIO WORLD --program build/test/conformance/conformance [--out DIR]
         [--summary DIR]  (writes DIR/SCENARIO-wWORLD.json for docs.py)

1. Writes DIR/cases.pt (the scenario module's cases(world)) and DIR/ref.pt (its
   reference(): the plain op on the full tensors, single process, no DTensor).
2. torchrun N ranks of oracle.py (PyTorch from the venv) -> DIR/torch/rank<r>.pt, or the
   same records from the oracle cache ([Note: the oracle cache] below).
3. N ranks of the dtensor program (test/launch.py) -> DIR/dtensor/rank<r>.pt.
4. Compares record by record (compare.py) and exits non-zero on any difference that the
   scenario does not explain (by_design()).
"""
import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import compare  # noqa: E402


def launch(world, argv, timeout, log):
    """PyTorch's side under torchrun, as its users run it; dtensor's program ("--no-python")
    under test/launch.py, with torchrun's variables ([Note: the test launcher])."""
    if argv[0] == "--no-python":
        cmd = [sys.executable, os.path.join(HERE, "..", "launch.py"), str(world)] + argv[1:]
    else:
        exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [exe, "--standalone", f"--nproc-per-node={world}"] + argv
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.time() - t0


# [Note: the oracle cache]
# PyTorch's side of a scenario depends only on the PyTorch build and on this suite's Python
# (the scenario module, its cases and reference, oracle.py, the helpers they import), never on
# dtensor: rerunning it for every change to dtensor repeats the same records. Its records are
# kept under $DTENSOR_ORACLE_CACHE (default ~/.cache/dtensor/oracle, outside the clone, so
# clean clones share it), keyed by the torch version and git revision, the world size, the
# scenario, a hash of the .py files the scenario depends on (key_sources: the shared ones, its
# own, and the scenario files they name) and of the cases file this run wrote (the inputs both
# sides read); any change to one of them is a new key, so PyTorch runs again. The reference (the plain op on one process, PyTorch's too) is kept with them.
# DTENSOR_ORACLE_RERUN=1 always runs PyTorch (and refreshes the entry). Only a run that
# finished on every rank is kept. The judge is still PyTorch: its records, once per key.
def key_sources(scenario):
    """The .py files a scenario's records depend on: every shared one (not a scenario's),
    its own sc_<scenario>.py, and the other scenarios' files these name (sc_sweep_full imports
    sc_sweep; opinfo_record, sc_ops). Another scenario's file is not one of them, so adding or
    changing a scenario reruns PyTorch for that scenario only."""
    files = {p for p in glob.glob(os.path.join(HERE, "*.py"))
             if not os.path.basename(p).startswith("sc_")}
    files.add(os.path.join(HERE, f"sc_{scenario}.py"))
    todo = list(files)
    while todo:
        for name in re.findall(r"\bsc_(\w+)", open(todo.pop()).read()):
            path = os.path.join(HERE, f"sc_{name}.py")
            if os.path.isfile(path) and path not in files:
                files.add(path)
                todo.append(path)
    return sorted(files)


def oracle_key(scenario, world, out):
    h = hashlib.sha256()
    h.update(f"{torch.__version__} {torch.version.git_version} {scenario} {world}\n".encode())
    h.update(open(os.path.join(out, "cases.pt"), "rb").read())
    for path in key_sources(scenario):
        h.update(os.path.basename(path).encode())
        h.update(open(path, "rb").read())
    return h.hexdigest()[:24]


def oracle_cache_dir(scenario, world, out):
    root = os.environ.get("DTENSOR_ORACLE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "dtensor", "oracle")
    return os.path.join(root, f"{scenario}-w{world}-{oracle_key(scenario, world, out)}")


def oracle_from_cache(scenario, world, out):
    """Copies the cached records into out/torch; False when there are none (or a rerun is
    asked for)."""
    cached = oracle_cache_dir(scenario, world, out)
    if os.environ.get("DTENSOR_ORACLE_RERUN") == "1" or not os.path.isfile(
            os.path.join(cached, "complete")):
        return False
    shutil.copytree(os.path.join(cached, "torch"), os.path.join(out, "torch"))
    for name in ("torch.log", "ref.pt"):
        shutil.copy(os.path.join(cached, name), os.path.join(out, name))
    return True


def oracle_to_cache(scenario, world, out):
    """Keeps this run's PyTorch records. Best effort: a cache that cannot be written (a full
    disk, a file where the directory should be) costs the next run time, never this verdict."""
    cached = oracle_cache_dir(scenario, world, out)
    tmp = f"{cached}.tmp{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        shutil.copytree(os.path.join(out, "torch"), os.path.join(tmp, "torch"))
        for name in ("torch.log", "ref.pt"):
            shutil.copy(os.path.join(out, name), os.path.join(tmp, name))
        open(os.path.join(tmp, "complete"), "w").write("")
        shutil.rmtree(cached, ignore_errors=True)  # an older entry of this same key
        os.replace(tmp, cached)  # whole or not at all: `complete` only in a full entry
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"[conformance] the oracle cache was not written ({cached}): {e}")


def died_of_signal(log):
    """The signal that ended a rank, as torchrun's log names it ("exitcode: -11", "Signal 6
    (SIGABRT)"), or None. SIGTERM is torchrun's own, sent to the other ranks after one failed."""
    for m in re.finditer(r"exitcode: -(\d+)\)|Signal (\d+) \(", open(log).read()):
        if (m.group(1) or m.group(2)) != "15":
            return f"signal {m.group(1) or m.group(2)}"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("world", type=int)
    ap.add_argument("--program", required=True)
    ap.add_argument("--out")
    ap.add_argument("--summary")
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()

    mod = __import__("sc_" + args.scenario)
    out = args.out or tempfile.mkdtemp(prefix=f"conformance-{args.scenario}-w{args.world}-")
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    cases = mod.cases(args.world)
    torch.save(cases, os.path.join(out, "cases.pt"))
    cached = oracle_from_cache(args.scenario, args.world, out)
    if not cached:
        torch.save(mod.reference(cases), os.path.join(out, "ref.pt"))

    sides = {
        "torch": [os.path.join(HERE, "oracle.py"), args.scenario, out],
        "dtensor": ["--no-python", os.path.abspath(args.program), args.scenario, out],
    }
    status = {}
    for side, argv in sides.items():
        if side == "torch" and cached:
            status[side] = 0
            print(f"[conformance] {args.scenario} w{args.world}: torch records from the oracle "
                  f"cache ({oracle_cache_dir(args.scenario, args.world, out)})")
            continue
        rc, secs = launch(args.world, argv, args.timeout, os.path.join(out, side + ".log"))
        signal = side == "torch" and rc != 0 and died_of_signal(os.path.join(out, "torch.log"))
        if signal:
            # PyTorch, the oracle, sometimes loses a rank to a signal on a loaded machine
            # (seen in CI: SIGABRT "terminate called without an active exception", misuse, 2
            # ranks; SIGSEGV, redistribute, 4 ranks). A crash of the reference is not a
            # verdict on dtensor: run it once more, and say so.
            shutil.copy(os.path.join(out, "torch.log"), os.path.join(out, "torch-crashed.log"))
            print(f"[conformance] {args.scenario} w{args.world}: torch lost a rank ({signal}) "
                  f"after {secs:.1f} s; running the PyTorch side once more")
            rc, secs = launch(args.world, argv, args.timeout, os.path.join(out, side + ".log"))
        status[side] = rc
        print(f"[conformance] {args.scenario} w{args.world}: {side} exit {rc} in {secs:.1f} s")
        if side == "torch" and rc == 0:
            oracle_to_cache(args.scenario, args.world, out)
    if status["dtensor"] != 0:
        print(open(os.path.join(out, "dtensor.log")).read()[-4000:])
        print(f"[conformance] FAILED: the dtensor side did not finish ({status['dtensor']})")
        return 1
    if status["torch"] != 0:
        print(open(os.path.join(out, "torch.log")).read()[-4000:])
        print(f"[conformance] FAILED: the PyTorch side did not finish ({status['torch']})")
        return 1
    # A scenario with its own verdict (the operator sweep judges per overload) brings it.
    report = mod.judge(out, args.world) if hasattr(mod, "judge") else \
        compare.compare(mod, out, args.world)
    report.print()
    if args.summary:
        report.write_summary(args.summary, args.scenario, args.world)
    if not args.out and report.ok():
        shutil.rmtree(out)
    else:
        print(f"[conformance] results kept in {out}")
    return 0 if report.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
