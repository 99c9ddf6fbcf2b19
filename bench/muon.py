"""Muon's optimizer step: dtensor (bench/muon.cpp) against PyTorch 2.15's torch.optim.Muon on
the same layout (the parameters DTensors Shard(0) over every rank, FSDP2's layout, which
torch.optim.Muon runs through DTensor's op dispatch) and on one process (full matrices, what
a rank computes when it runs PyTorch's Muon on gathered matrices), with AdamW's step on the
same layout as the yardstick.

Driver:  python bench/muon.py TORCHRUN BENCH_BIN [--ranks 2 4] [--rounds 3] [--dim 256]
                 [--layers 2] [--steps 5] [--recipe TRAIN_BIN]
Worker:  torchrun ... bench/muon.py --worker [model flags]   (PyTorch's distributed side)

The parameters (both sides): --layers Llama-like blocks, wq, wk, wv, wo [D, D], w1, w3 [3D, D],
w2 [D, 3D] by Muon (lr 0.02, PyTorch's defaults otherwise), two norms [D] a block by AdamW
(lr 3e-3, betas 0.9 / 0.95); fixed random gradients; one thread a rank. Per rank count and
round: PyTorch's worker, then dtensor's program; each times --steps AdamW-only steps, then
--steps Muon + AdamW steps, each from a barrier, and reports the median. The table: medians
over rounds (min-max), ratios as medians of per-round ratios; collectives of one Muon step
(PyTorch's CommDebugMode, dtensor's); bytes a rank sends in one Muon step, the mean over ranks
(dtensor: 2 bytes an element of the pieces that travel, to the owners and back; the formula
for even shards: 2 x 2 x (N - 1) / N x elements / N).

With --recipe: the whole training step of the main job (examples/train, Llama 3 of width --dim
and --layers blocks, fp32, batch 16 x 64) on 4 ranks as dp_shard 2 x tp 2 with AdamW and
with Muon, alternating, --rounds each: the median step time of steps 2-9.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_util import torchrun_result  # bench/bench_util.py (this script's folder)


def shapes(dim, layers):
    out = []
    for l in range(layers):
        for name, shape in (("wq", (dim, dim)), ("wk", (dim, dim)), ("wv", (dim, dim)),
                            ("wo", (dim, dim)), ("w1", (3 * dim, dim)), ("w3", (3 * dim, dim)),
                            ("w2", (dim, 3 * dim)), ("attention_norm", (dim,)),
                            ("ffn_norm", (dim,))):
            out.append((f"{l}.{name}", shape))
    return out


def optimizers(torch, params, muon):
    mats = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    adamw = dict(lr=3e-3, betas=(0.9, 0.95))
    if not muon:
        return [torch.optim.AdamW(params, **adamw)]
    return [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, **adamw)]


def time_steps(torch, opts, steps, barrier):
    t = []
    for _ in range(steps):
        barrier()
        t0 = time.perf_counter()
        for o in opts:
            o.step()
        barrier()
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


def worker(a):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    params = []
    for _, shape in shapes(a.dim, a.layers):
        p = torch.nn.Parameter(distribute_tensor(torch.randn(shape) * 0.02, mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(shape), mesh, [Shard(0)])
        params.append(p)
    # Values first: one Muon step of PyTorch's on these DTensors against its own on the full
    # matrices in this process (dtensor's equals the latter bit for bit: test_muon).
    full = [torch.nn.Parameter(p.full_tensor().detach().clone()) for p in params]
    for f, p in zip(full, params):
        f.grad = p.grad.full_tensor()
    saved = [p.detach().to_local().clone() for p in params]
    for o in optimizers(torch, params, True):
        o.step()
    for o in optimizers(torch, full, True):
        o.step()
    diff = max((p.full_tensor() - f).abs().max().item() for p, f in zip(params, full))
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.to_local().copy_(s)
    adamw, muon = optimizers(torch, params, False), optimizers(torch, params, True)
    result = {"adamw_s": time_steps(torch, adamw, a.steps, dist.barrier),
              "muon_s": time_steps(torch, muon, a.steps, dist.barrier)}
    mode = CommDebugMode()
    with mode:
        for o in muon:
            o.step()
    result["collectives"] = mode.get_total_counts()
    result["max_abs_vs_one_process"] = diff
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def one_process(a):
    """torch.optim.Muon on full matrices in this process, one thread."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = []
    for _, shape in shapes(a.dim, a.layers):
        p = torch.nn.Parameter(torch.randn(shape) * 0.02)
        p.grad = torch.randn(shape)
        params.append(p)
    return time_steps(torch, optimizers(torch, params, True), a.steps, lambda: None)


def recipe_step(torchrun, train, opt, a, out):
    metrics = os.path.join(out, f"metrics-{opt}.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([torchrun, "--standalone", "--nproc-per-node=4", "--no-python", train,
                    "--dim", str(a.dim), "--layers", str(a.layers), "--heads", "8",
                    "--precision", "fp32", "--seq", "64", "--batch", "16", "--steps", "10",
                    "--mesh", "1x2x2", "--optimizer", opt, "--metrics", metrics,
                    "--log-every", "100"], capture_output=True, text=True, env=env, check=True,
                   cwd=out)
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return statistics.median(r["step_s"] for r in rows if r.get("step", 0) >= 2)


def spread(v, scale=1e3):
    v = [x * scale for x in v]
    return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("torchrun", nargs="?")
    ap.add_argument("bench", nargs="?")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--recipe")
    a = ap.parse_args()
    model = ["--dim", str(a.dim), "--layers", str(a.layers), "--steps", str(a.steps)]
    if a.worker:
        return worker(a)
    me = os.path.abspath(__file__)
    if a.recipe:
        import tempfile
        with tempfile.TemporaryDirectory() as out:
            steps = {"AdamW": [], "Muon": []}
            for _ in range(a.rounds):
                for opt in steps:
                    steps[opt].append(recipe_step(a.torchrun, a.recipe, opt, a, out))
        ratio = statistics.median(m / w for m, w in zip(steps["Muon"], steps["AdamW"]))
        print(f"recipe, 4 ranks (dp_shard 2 x tp 2), dim {a.dim}, {a.layers} layers: step "
              f"AdamW {spread(steps['AdamW'])} ms, Muon {spread(steps['Muon'])} ms, "
              f"Muon / AdamW {ratio:.2f}x")
        return 0
    single = [one_process(a) for _ in range(a.rounds)]
    print(f"torch.optim.Muon on one process (full matrices), dim {a.dim}, {a.layers} layers: "
          f"{spread(single)} ms a step")
    print("| ranks | AdamW step, dtensor / PyTorch (ms) | Muon + AdamW step, dtensor / PyTorch "
          "(ms) | dtensor Muon / PyTorch's | / one process | dtensor Muon's extra over AdamW, "
          "x AdamW's step | collectives a Muon step, dtensor / PyTorch | bytes a rank sends, "
          "mean (formula) | PyTorch's Muon on DTensors against its own on one process, max abs |")
    print("| ---: | --- | --- | ---: | ---: | ---: | --- | --- | ---: |")
    for n in a.ranks:
        rows = []
        for _ in range(a.rounds):
            pt = torchrun_result(a.torchrun, n, [me, "--worker"] + model)
            dt = torchrun_result(a.torchrun, n,
                                 ["--no-python", a.bench] + model + ["--rounds", "1"])
            rows.append((pt, dt))
        d_adamw = [r[1]["adamw_s"][0] for r in rows]
        d_muon = [r[1]["muon_s"][0] for r in rows]
        p_adamw = [r[0]["adamw_s"] for r in rows]
        p_muon = [r[0]["muon_s"] for r in rows]
        ratio = statistics.median([d / p for d, p in zip(d_muon, p_muon)])
        vs_one = statistics.median([d / s for d, s in zip(d_muon, single)])
        extra = statistics.median([(m - w) / w for m, w in zip(d_muon, d_adamw)])
        dt = rows[-1][1]
        formula = 2 * 2 * (n - 1) * dt["matrix_elements"] // (n * n)
        print(f"| {n} | {spread(d_adamw)} / {spread(p_adamw)} | {spread(d_muon)} / "
              f"{spread(p_muon)} | {ratio:.2f}x | {vs_one:.2f}x | {extra:.1f}x | "
              f"{dt['all_to_alls']} all-to-alls / {rows[-1][0]['collectives']} | "
              f"{dt['bytes_in_mean']} ({formula}) | {rows[-1][0]['max_abs_vs_one_process']:.2e} |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
