"""The simulated world judged by the real one (test/sim/simulate_worker.cpp).

For worlds 1, 2 and 4: the step run for real under torchrun (Gloo, CPU) and the same step
simulated in one process, rank by rank, on the fake backend and meta tensors. Every rank's
report must be equal: the collectives (kind, group, ranks, reduce op, dtype, shape, bytes) in
order per phase, the FLOPs per phase, parameter / gradient / optimizer bytes and fully_shard's
peak. Then a broken plan (rank 1 skips clip_grad_norm_'s all-reduces) must be reported by the
plan check, naming the groups, the position and rank 1.
"""
import json
import os
import subprocess
import sys
import tempfile

torchrun, worker = sys.argv[1], sys.argv[2]
env = dict(os.environ, OMP_NUM_THREADS="1")


def reports(d, world):
    return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]


def run(args):
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


fields = ["parameter_bytes", "gradient_bytes", "optimizer_bytes", "fsdp_peak_bytes"]
with tempfile.TemporaryDirectory() as tmp:
    for world in (1, 2, 4):
        real, sim = os.path.join(tmp, f"real{world}"), os.path.join(tmp, f"sim{world}")
        run([torchrun, "--standalone", f"--nproc-per-node={world}", "--no-python", worker, "real", real])
        out = run([worker, "simulate", sim, str(world)])
        assert "plan consistent" in out, out
        for a, b in zip(reports(real, world), reports(sim, world)):
            assert not a["simulated"] and b["simulated"]
            for f in fields:
                assert a[f] == b[f], (world, a["rank"], f, a[f], b[f])
            assert a["parameter_bytes"] > 0 and a["optimizer_bytes"] == 2 * a["parameter_bytes"]
            assert [p["name"] for p in a["phases"]] == ["forward", "backward", "optimizer"]
            for pa, pb in zip(a["phases"], b["phases"]):
                assert pa["flops"] == pb["flops"], (world, pa["name"], pa["flops"], pb["flops"])
                assert pa["flops"] > 0 or pa["name"] == "optimizer", (world, pa["name"])
                ca = [{k: c[k] for k in c if k != "async"} for c in pa["collectives"]]
                cb = [{k: c[k] for k in c if k != "async"} for c in pb["collectives"]]
                assert ca == cb, (world, a["rank"], pa["name"], ca, cb)
            n = sum(len(p["collectives"]) for p in a["phases"])
            print(f"world {world} rank {a['rank']}: {n} collectives, "
                  f"{sum(p['flops'] for p in a['phases'])} FLOPs, "
                  f"{a['parameter_bytes']} parameter bytes: real == simulated")
    out = run([worker, "simulate", os.path.join(tmp, "broken"), "4", "broken"])
    print(out)
    assert "plan inconsistent" in out, out
    lines = [l for l in out.splitlines() if l.startswith("mismatch:")]
    assert lines and all("rank 1 issues nothing" in l for l in lines), lines
    assert any("group dp (ranks [1, 3])" in l for l in lines), lines
    assert any("group tp (ranks [0, 1])" in l for l in lines), lines
print("simulated == real on worlds 1, 2, 4; the broken plan is caught")
