"""Runs one conformance scenario on N ranks under PyTorch and under dtensor and compares.

  run.py SCENARIO WORLD --program build/test/conformance/conformance [--out DIR]
         [--summary DIR]  (writes DIR/SCENARIO-wWORLD.json for docs.py)

1. Writes DIR/cases.pt (the scenario module's cases(world)) and DIR/ref.pt (its
   reference(): the plain op on the full tensors, single process, no DTensor).
2. torchrun N ranks of oracle.py (PyTorch 2.9.1 from the venv) -> DIR/torch/rank<r>.pt.
3. torchrun N ranks of the dtensor program -> DIR/dtensor/rank<r>.pt.
4. Compares record by record (compare.py) and exits non-zero on any difference that the
   scenario does not explain (by_design()).
"""
import argparse
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


def torchrun(world, argv, timeout, log):
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [exe, "--standalone", f"--nproc-per-node={world}"] + argv
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.time() - t0


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
    torch.save(mod.reference(cases), os.path.join(out, "ref.pt"))

    sides = {
        "torch": [os.path.join(HERE, "oracle.py"), args.scenario, out],
        "dtensor": ["--no-python", os.path.abspath(args.program), args.scenario, out],
    }
    status = {}
    for side, argv in sides.items():
        rc, secs = torchrun(args.world, argv, args.timeout, os.path.join(out, side + ".log"))
        signal = side == "torch" and rc != 0 and died_of_signal(os.path.join(out, "torch.log"))
        if signal:
            # PyTorch, the oracle, sometimes loses a rank to a signal on a loaded machine
            # (seen in CI: SIGABRT "terminate called without an active exception", misuse, 2
            # ranks; SIGSEGV, redistribute, 4 ranks). A crash of the reference is not a
            # verdict on dtensor: run it once more, and say so.
            shutil.copy(os.path.join(out, "torch.log"), os.path.join(out, "torch-crashed.log"))
            print(f"[conformance] {args.scenario} w{args.world}: torch lost a rank ({signal}) "
                  f"after {secs:.1f} s; running the PyTorch side once more")
            rc, secs = torchrun(args.world, argv, args.timeout, os.path.join(out, side + ".log"))
        status[side] = rc
        print(f"[conformance] {args.scenario} w{args.world}: {side} exit {rc} in {secs:.1f} s")
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
