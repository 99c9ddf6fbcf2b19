"""Running examples/train under torchrun and comparing its metrics, for the recipe tests that
judge one layout by another (cp_recipe.py, pp_recipe.py)."""
import hashlib
import json
import os
import re
import subprocess
import sys


def launch(torchrun, train, nproc, args):
    """examples/train on `nproc` ranks with `args`: the finished process."""
    return subprocess.run([torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python",
                           train, *args], capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def run(torchrun, train, nproc, out, flags, extra):
    """A run that must succeed: its metrics records (one per step) and its sample line(s)."""
    name = "-".join(extra) or "plain"
    slug = re.sub('[^A-Za-z0-9]+', '-', name)
    if len(slug) > 80:  # a file name holds at most 255 bytes: flags naming paths run past it
        slug = slug[:60] + "-" + hashlib.sha1(slug.encode()).hexdigest()[:12]
    metrics = os.path.join(out, f"metrics-{nproc}-{slug}.jsonl")
    if os.path.exists(metrics):  # a resumed run appends to its file: start afresh
        os.remove(metrics)
    p = launch(torchrun, train, nproc, [*flags, *extra, "--metrics", metrics])
    print(p.stdout[-2000:])
    if p.returncode != 0:
        print(p.stderr[-3000:])
        sys.exit(f"{name}: exit {p.returncode}")
    sample = [line for line in p.stdout.splitlines() if line.startswith("sample:")]
    return [json.loads(line) for line in open(metrics)], sample


def compare(label, got, want, rel=2e-4):
    """Every step's loss and gradient norm within `rel` (relative), as many steps."""
    ok = len(got) == len(want)
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm"):
            if abs(a[key] - b[key]) > rel * abs(b[key]):
                print(f"FAIL {label} step {a['step']}: {key} {a[key]} against {b[key]}")
                ok = False
    print(f"{label}: losses {[round(r['loss'], 5) for r in got]} "
          f"against {[round(r['loss'], 5) for r in want]}")
    return ok


def fortune_files(fortunes, names=("fortunes", "literature", "wisdom")):
    """The paths of Debian's fortune files (scripts/setup.sh installs them); exits naming the
    package when one is missing."""
    paths = [os.path.join(fortunes, n) for n in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        sys.exit(f"FAIL: {missing} missing: Debian's `fortunes` package (scripts/setup.sh)")
    return paths


def hf_tensors(folder):
    """The tensors of a Hugging Face folder's safetensors files (one or several), by name."""
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out
