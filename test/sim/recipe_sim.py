"""The Llama 3 recipe simulated, judged by the real run and by formulas (docs/simulation.md).

usage: recipe_sim.py TORCHRUN TRAIN TORCH_ESTIMATE

1. Real against simulated: the recipe (examples/train, small config) run for real under
   torchrun (Gloo, CPU) on 1, 2, 4 and 8 ranks, and on 8 ranks with one sequence per
   data-parallel rank, then every rank simulated (DTENSOR_SIMULATE=WORLD:RANK) with the same
   flags. The last step's reports must be equal: every collective of each phase in order
   (kind, group, ranks, reduce op, dtype, shape, bytes, async), the FLOPs of each phase,
   parameter / gradient / optimizer bytes, fully_shard's peak.
2. Formulas: every report above, and simulated ranks of Llama 3 8B on 1,024 ranks (8x16x8)
   and 70B on 64 and 512, against values computed here from the model's shapes alone: this
   rank's parameter, gradient and AdamW bytes (fp32 shards: torch.chunk pieces of the
   tensor-parallel piece over dp_shard), the FLOPs of forward (2 x tokens x weights of the
   products + 4 b h s^2 d of attention) and backward (twice the forward, plus the forward
   recomputed by full activation checkpointing except the output projection), and
   fully_shard's bytes per step within 1% of the minimum (bf16 parameters all-gathered once
   in forward and once more in backward for every unit but the last one forward used, [norm,
   output]: the blocks and tok_embeddings; fp32 gradients reduce-scattered once).
3. PyTorch's estimate (tools/torch_estimate.py: its fake process group, FakeTensorMode and
   FSDPMemTracker on the same model and mesh) gives the same parameter, gradient and AdamW
   bytes as dtensor's simulated rank.
4. The driver: `train --simulate 16 --mesh 2x2x4,1x4x4` simulates all 16 ranks of both
   meshes, finds both plans consistent and draws the chart; `--simulate 128 --mesh 2x8x8 --sample 4` simulates
   the extremes of every mesh coordinate (computed here) and at most 4 more; the predicted
   time is consistent with its parts (the timeline: at least compute and the waits, at most
   every collective in turn) and tokens/s with the step's tokens; --report and --metrics, the
   driver's own, refused by name.
5. The driver with --pp 2 (a later stage's input shape through DTENSOR_SIMULATE_P2P, the bubble
   of 1F1B with 4 microbatches on 2 stages: 1/5, the step 5/4 of the rank's own), --cp 2 and a
   DeepSeek-V3-style MoE with --ep 8 (even routing): every plan consistent, bytes over pp, cp, ep.
6. The layout search (`train --plan`) on 8 ranks: the ranking in order, `--find` where the
   ranking puts the layout, the best layout's --simulate flags planned by the driver and
   consistent, an unknown model refused by name.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

torchrun, train, estimate = sys.argv[1], sys.argv[2], sys.argv[3]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
SMALL = dict(dim=64, layers=2, heads=4, kv_heads=2, vocab=128, multiple_of=32, mult=0.0)
PRESETS = {
    "llama3-8b": dict(dim=4096, layers=32, heads=32, kv_heads=8, vocab=128256, multiple_of=1024,
                      mult=1.3),
    "llama3-70b": dict(dim=8192, layers=80, heads=64, kv_heads=8, vocab=128256,
                       multiple_of=4096, mult=1.3),
}


def run(args, env=ENV, ok=(0,)):
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode not in ok:
        sys.exit(f"{' '.join(args)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p.stdout


def load(d, r):
    return json.load(open(os.path.join(d, f"rank{r}.json")))


def simulate(world, rank, out, flags):
    env = dict(ENV, DTENSOR_SIMULATE=f"{world}:{rank}")
    run([train, "--report", out, "--metrics", os.path.join(out, "m.jsonl")] + flags, env=env)
    return load(out, rank)


# --- formulas ------------------------------------------------------------------------------

def hidden_of(m):  # torchtitan's FeedForward width
    h = int(2 * (4 * m["dim"]) / 3)
    if m["mult"]:
        h = int(m["mult"] * h)
    return m["multiple_of"] * ((h + m["multiple_of"] - 1) // m["multiple_of"])


def chunk(n, k, i):  # torch.chunk's i-th piece of n over k
    size = (n + k - 1) // k
    return max(0, min(size, n - i * size))


def parameters(m, tp):
    """(name, tensor-parallel local shape, in a block?) of every parameter."""
    d, hd = m["dim"], m["dim"] // m["heads"]
    kv, hid, v = m["kv_heads"] * hd, hidden_of(m), m["vocab"]
    col = lambda o, i: (chunk(o, tp, 0), i)  # Shard(0) of [out, in]; even here
    row = lambda o, i: (o, chunk(i, tp, 0))  # Shard(1)
    out = [("tok_embeddings", col(v, d), False), ("norm", (d,), False), ("output", col(v, d), False)]
    for _ in range(m["layers"]):
        out += [("wq", col(d, d), True), ("wk", col(kv, d), True), ("wv", col(kv, d), True),
                ("wo", row(d, d), True), ("w1", col(hid, d), True), ("w3", col(hid, d), True),
                ("w2", row(d, hid), True), ("attention_norm", (d,), True),
                ("ffn_norm", (d,), True)]
    return out


def numel(shape):
    return math.prod(shape)


def expected_bytes(m, mesh, rank):
    """This rank's fp32 parameter bytes: the dp_shard-th torch.chunk of its tp piece."""
    shard = (rank // mesh[2]) % mesh[1]
    n = 0
    for _, shape, _ in parameters(m, mesh[2]):
        n += chunk(shape[0], mesh[1], shard) * numel(shape[1:])
    return 4 * n


def expected_flops(m, mesh, batch, seq):
    tp, dp = mesh[2], mesh[0] * mesh[1]
    tokens = batch // dp * seq
    d, hd = m["dim"], m["dim"] // m["heads"]
    kv, hid = m["kv_heads"] * hd, hidden_of(m)
    block = d * d + 2 * kv * d + d * d + 3 * hid * d
    out = 2 * tokens * m["vocab"] * d // tp
    attention = 4 * (batch // dp) * (m["heads"] // tp) * seq * seq * hd
    fwd = 2 * tokens * block * m["layers"] // tp + out + attention * m["layers"]
    return fwd, 3 * fwd - out


def check_formulas(m, mesh, batch, seq, r, what):
    p = expected_bytes(m, mesh, r["rank"])
    assert r["parameter_bytes"] == p, (what, "parameters", r["parameter_bytes"], p)
    assert r["gradient_bytes"] == p, (what, "gradients", r["gradient_bytes"], p)
    assert r["optimizer_bytes"] == 2 * p, (what, "AdamW", r["optimizer_bytes"], 2 * p)
    fwd, bwd = expected_flops(m, mesh, batch, seq)
    got = {ph["name"]: ph["flops"] for ph in r["phases"]}
    assert got["forward"] == fwd and got["backward"] == bwd, (what, got, fwd, bwd)
    tp_numel = sum(numel(s) for _, s, _ in parameters(m, mesh[2]))
    again_numel = sum(numel(s) for name, s, b in parameters(m, mesh[2])
                      if b or name == "tok_embeddings")
    gathered = sum(c["bytes_out"] for ph in r["phases"] for c in ph["collectives"]
                   if c["group"] == "dp_shard" and c["kind"] == "all_gather")
    scattered = sum(c["bytes_in"] for ph in r["phases"] for c in ph["collectives"]
                    if c["group"] == "dp_shard" and c["kind"] == "reduce_scatter")
    ag_min, rs_min = 2 * (tp_numel + again_numel), 4 * tp_numel
    if mesh[1] > 1:
        assert ag_min <= gathered <= 1.01 * ag_min, (what, "all-gather bytes", gathered, ag_min)
        assert rs_min <= scattered <= 1.01 * rs_min, (what, "reduce-scatter", scattered, rs_min)
    print(f"{what}: rank {r['rank']}: parameters {p} B, forward {fwd:.4g} / backward {bwd:.4g} "
          f"FLOPs, all-gather {gathered} B ({gathered / ag_min:.5f} x min), reduce-scatter "
          f"{scattered} B ({(scattered / rs_min) if rs_min else 0:.5f} x min): as the formulas")


with tempfile.TemporaryDirectory() as tmp:
    # 1. real == simulated, and both as the formulas
    cases = [(1, "1x1x1", 32), (2, "1x1x2", 32), (4, "1x2x2", 32), (8, "2x2x2", 32),
             (8, "2x2x2", 4)]
    for world, mesh_s, batch in cases:
        mesh = [int(x) for x in mesh_s.split("x")]
        flags = ["--mesh", mesh_s, "--steps", "2", "--batch", str(batch), "--log-every", "1"]
        real = os.path.join(tmp, f"real{world}-{batch}")
        # Two steps may not lower the loss enough for the recipe's own check (exit 1): the
        # reports are what is judged here.
        run([torchrun, "--standalone", f"--nproc-per-node={world}", "--no-python", train,
             "--report", real, "--metrics", os.path.join(real, "m.jsonl")] + flags, ok=(0, 1))
        for rank in range(world):
            a = load(real, rank)
            b = simulate(world, rank, os.path.join(tmp, f"sim{world}-{batch}"), flags)
            assert not a["simulated"] and b["simulated"] and b["peak_bytes"] > 0
            for f in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "fsdp_peak_bytes",
                      "tokens"):
                assert a[f] == b[f], (world, batch, rank, f, a[f], b[f])
            assert [p["name"] for p in a["phases"]] == ["forward", "backward", "optimizer"]
            for pa, pb in zip(a["phases"], b["phases"]):
                assert pa["flops"] == pb["flops"], (world, rank, pa["name"])
                assert pa["collectives"] == pb["collectives"], (world, batch, rank, pa["name"])
            kinds = {c["kind"] for p in a["phases"] for c in p["collectives"]}
            assert "all_to_all" not in kinds, (world, batch, kinds)
            check_formulas(SMALL, mesh, batch, 32, a, f"recipe {mesh_s} batch {batch} real")
        n = sum(len(p["collectives"]) for p in a["phases"])
        print(f"world {world} ({mesh_s}, batch {batch}): {world} ranks, {n} collectives each: "
              "real == simulated")

    # 1b. context parallelism (--cp 2 on 8 ranks, both methods): the first and last ranks'
    # reports, real == simulated (the formulas above assume no cp).
    for method in ("allgather", "ring"):
        flags = ["--mesh", "1x2x2", "--cp", "2", "--cp-method", method, "--seq", "64",
                 "--steps", "2", "--batch", "4", "--log-every", "1"]
        real = os.path.join(tmp, f"real-cp-{method}")
        run([torchrun, "--standalone", "--nproc-per-node=8", "--no-python", train,
             "--report", real, "--metrics", os.path.join(real, "m.jsonl")] + flags, ok=(0, 1))
        for rank in (0, 7):
            a = load(real, rank)
            b = simulate(8, rank, os.path.join(tmp, f"sim-cp-{method}"), flags)
            for f in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "fsdp_peak_bytes",
                      "tokens"):
                assert a[f] == b[f], ("cp", method, rank, f, a[f], b[f])
            for pa, pb in zip(a["phases"], b["phases"]):
                assert pa["flops"] == pb["flops"], ("cp", method, rank, pa["name"])
                assert pa["collectives"] == pb["collectives"], ("cp", method, rank, pa["name"])
        print(f"cp 2 ({method}) x dp_shard 2 x tp 2: ranks 0 and 7, real == simulated")

    # 2. the presets at scale, simulated, against the formulas
    # 8B with one sequence per data-parallel rank (128 over 8 x 16): the tensor-parallel
    # conversions at module boundaries keep its backward at twice the forward's FLOPs
    # ([Note: tensor parallelism on the module seam]).
    for preset, mesh_s, ranks, batch in (("llama3-8b", "8x16x8", (0, 1023), 128),
                                         ("llama3-70b", "1x8x8", (0, 63), 16),
                                         ("llama3-70b", "2x32x8", (0, 511), 128)):
        mesh = [int(x) for x in mesh_s.split("x")]
        world = math.prod(mesh)
        flags = ["--model", preset, "--mesh", mesh_s, "--seq", "8192", "--batch", str(batch),
                 "--steps", "2"]
        for rank in ranks:
            r = simulate(world, rank, os.path.join(tmp, f"{preset}-{mesh_s}"), flags)
            check_formulas(PRESETS[preset], mesh, batch, 8192, r, f"{preset} {mesh_s}")

    # 3. PyTorch's own estimate of the same rank
    for mesh_s, rank in (("2x2x2", 0), ("1x4x2", 5)):
        flags = ["--mesh", mesh_s, "--steps", "2", "--batch", "32"]
        mine = simulate(8, rank, os.path.join(tmp, f"est-{mesh_s}"), flags)
        hidden = hidden_of(SMALL)
        theirs = json.loads(run([sys.executable, estimate, "--model",
                                 f"64,2,4,2,128,{hidden}", "--mesh", mesh_s, "--rank", str(rank),
                                 "--batch", "32", "--seq", "32"]).strip().splitlines()[-1])
        for f in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
            assert mine[f] == theirs[f], (mesh_s, rank, f, mine[f], theirs[f])
        print(f"PyTorch's estimate {mesh_s} rank {rank}: parameters / gradients / AdamW "
              f"{theirs['parameter_bytes']} / {theirs['gradient_bytes']} / "
              f"{theirs['optimizer_bytes']} B, as dtensor's; its tracked peak "
              f"{theirs['tracker_peak']['Total']} B, dtensor's simulated peak {mine['peak_bytes']} B")

    # 4. the driver
    out = os.path.join(tmp, "drv16")
    text = run([train, "--simulate", "16", "--mesh", "2x2x4,1x4x4", "--kv-heads", "4",
                "--out", out, "--jobs", "2"])
    print(text)
    s = json.load(open(os.path.join(out, "simulation.json")))
    assert [m["mesh"] for m in s["meshes"]] == ["2x2x4", "1x4x4"], s["meshes"]
    for m in s["meshes"]:
        assert m["ranks"] == list(range(16)) and m["plan_mismatches"] == [], m
        t = m["time"]
        assert t["step_s"] > 0 and abs(sum(p["total_s"] for p in t["phases"]) - t["step_s"]) < 1e-9
        for p in t["phases"]:  # the timeline: compute and the waits in turn, at most all in turn
            least = p["compute_s"] + p["sync_comm_s"]
            assert least - 1e-12 <= p["total_s"] <= least + p["async_comm_s"] + 1e-12, p
        assert abs(t["tokens_per_s_per_gpu"] - 32 * 32 / 16 / t["step_s"]) < 1e-6 * t["tokens_per_s_per_gpu"]
    assert text.count("plan consistent") == 2, text
    for flag in ("--report", "--metrics"):  # where the driver reads its ranks' reports: its own
        p = subprocess.run([train, "--simulate", "2", flag, os.path.join(tmp, "mine")], env=ENV,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and f"{flag} is the planner's own" in p.stderr, \
            (p.returncode, p.stderr)
    with open(os.path.join(out, "simulation.png"), "rb") as png:  # the chart, by matplotlib
        assert png.read(8) == b"\x89PNG\r\n\x1a\n" and f"chart: {out}/simulation.png" in text

    out = os.path.join(tmp, "drv128")
    shape = [2, 8, 8]
    text = run([train, "--simulate", "128", "--mesh", "2x8x8", "--heads", "8", "--kv-heads", "8",
                "--sample", "4", "--out", out, "--jobs", "2"])
    print(text)
    m = json.load(open(os.path.join(out, "simulation.json")))["meshes"][0]
    extremes = set()
    for d in range(3):
        for at in (0, min(1, shape[d] - 1), shape[d] - 1):
            for last in (False, True):
                c = [at if e == d else (shape[e] - 1 if last else 0) for e in range(3)]
                extremes.add((c[0] * shape[1] + c[1]) * shape[2] + c[2])
    ranks = m["ranks"]
    assert ranks == sorted(set(ranks)) and extremes <= set(ranks), (ranks, extremes)
    assert 1 <= len(set(ranks) - extremes) <= 4 and all(0 <= r < 128 for r in ranks), ranks
    assert m["plan_mismatches"] == [], m

    # 5. the driver with pp, cp and ep (docs/simulation.md, "Pipeline and context parallelism")
    out = os.path.join(tmp, "drv-pp")
    text = run([train, "--simulate", "16", "--pp", "2", "--mesh", "1x4x2", "--layers", "4",
                "--out", out])
    m = json.load(open(os.path.join(out, "simulation.json")))["meshes"][0]
    assert m["plan_mismatches"] == [] and m["ranks"] == list(range(16)), m
    p = m["pipeline"]  # 1F1B, 4 microbatches on 2 stages: bubble (p-1)/(m+p-1), step x 5/4
    assert p["schedule"] == "1F1B" and p["microbatches"] == 4 and p["stages"] == 2, p
    assert abs(p["bubble_fraction"] - 1 / 5) < 1e-9 and abs(p["step_scale"] - 5 / 4) < 1e-9, p
    t = m["time"]
    assert abs(t["step_s"] - 1.25 * t["compute_only_step_s"]) < 1e-9 * t["step_s"], t
    assert m["bytes_by_dim"].get("pp", 0) > 0, m["bytes_by_dim"]  # the activations sent
    out = os.path.join(tmp, "drv-cp")
    text = run([train, "--simulate", "16", "--cp", "2", "--mesh", "1x4x2", "--out", out])
    m = json.load(open(os.path.join(out, "simulation.json")))["meshes"][0]
    assert m["plan_mismatches"] == [] and m["bytes_by_dim"].get("cp", 0) > 0, m
    out = os.path.join(tmp, "drv-ep")
    text = run([train, "--simulate", "16", "--model", "deepseek-v3", "--mesh", "1x8x2", "--ep", "8",
                "--out", out])
    m = json.load(open(os.path.join(out, "simulation.json")))["meshes"][0]
    assert m["plan_mismatches"] == [] and m["bytes_by_dim"].get("ep", 0) > 0, m
    # Capacity dispatch on ranks whose tensors have no values: nothing between the router and
    # the combine reads one (a read of a meta tensor fails); its buffers 1.25 x the rows (the
    # even routing's), float8 rows fewer bytes still.
    ep_bytes = {"variable": m["bytes_by_dim"]["ep"]}
    for name, extra in (("capacity", ["--ep-dispatch", "capacity"]),
                        ("float8", ["--ep-dispatch", "capacity", "--ep-float8-dispatch"])):
        out = os.path.join(tmp, "drv-ep-" + name)
        run([train, "--simulate", "16", "--model", "deepseek-v3", "--mesh", "1x8x2", "--ep", "8",
             "--out", out, *extra])
        m = json.load(open(os.path.join(out, "simulation.json")))["meshes"][0]
        assert m["plan_mismatches"] == [], m
        ep_bytes[name] = m["bytes_by_dim"]["ep"]
    ratio = ep_bytes["capacity"] / ep_bytes["variable"]
    assert 1.25 <= ratio < 1.35 and ep_bytes["float8"] < ep_bytes["capacity"], ep_bytes
    print(f"driver: ep 8 by capacity dispatch planned on meta ranks, {ratio:.3f} x the variable "
          f"dispatch's bytes, float8 rows {ep_bytes['float8'] / ep_bytes['capacity']:.3f} x")
    print("driver: pp 2 (bubble 1/5 of 1F1B with 4 microbatches), cp 2 and ep 8 planned, consistent")

# 6. The layout search (`train --plan`): its ranking in order, the asked-for layout where the
# ranking puts it, the best layout's printed --simulate flags a plan the recipe runs and finds
# consistent, and a model it does not know refused by name.
with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "plan.json")
    run([train, "--plan", "3", "--model", "llama3-8b", "--world", "8", "--seq", "8192",
         "--global-batch", "16", "--find", "dp_shard=8", "--json", out])
    plan = json.load(open(out))
    steps = [r["time_s"]["step"] for r in plan["ranked"]]
    assert steps == sorted(steps) and len(steps) > 3, steps
    found = plan["found"]
    assert plan["ranked"][found["rank"] - 1]["layout"] == found["layout"], found
    best = plan["ranked"][0]
    text = run([train, "--model", "llama3-8b", "--out", os.path.join(tmp, "sim")] +
               best["simulate"].split())
    m = json.load(open(os.path.join(tmp, "sim", "simulation.json")))["meshes"][0]
    assert m["plan_mismatches"] == [], m
    p = subprocess.run([train, "--plan", "1", "--model", "llama5", "--world", "8"], env=ENV,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "llama3-8b" in p.stderr, (p.returncode, p.stderr)
    print(f"plan: {len(steps)} layouts of 8 ranks ranked; the best ({best['layout']}) simulated, "
          "consistent")
print("recipe: simulated == real on 1, 2, 4, 8 ranks; 8B / 70B as the formulas; driver checked "
      "with pp, cp, ep; the layout search's best simulated")
