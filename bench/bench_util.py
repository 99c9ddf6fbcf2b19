"""Helpers shared by the Python benchmark drivers and their PyTorch workers (bench/*.py)."""
import ctypes
import json
import os
import re
import subprocess


def live_bytes(name):
    """bench/live_bytes.cpp's counter `name` when it is preloaded (LD_PRELOAD), else None."""
    fn = getattr(ctypes.CDLL(None), name, None)
    if fn is not None:
        fn.restype = ctypes.c_int64 if name != "live_bytes_reset_peak" else None
    return fn


def torchrun_result(torchrun, nproc, argv):
    """Runs `argv` on `nproc` ranks under torchrun (one thread a rank) and returns the JSON of
    the RESULT line rank 0 prints."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([torchrun, "--standalone", f"--nproc-per-node={nproc}"] + argv,
                         capture_output=True, text=True, env=env, check=True).stdout
    m = re.search(r"^RESULT (.*)$", out, re.M)
    if not m:
        raise RuntimeError("no RESULT line in:\n" + out)
    return json.loads(m.group(1))
