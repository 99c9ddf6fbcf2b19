#!/usr/bin/env python3
"""The Llama 3 recipe, dtensor against PyTorch (docs/benchmarks.md "Llama 3 recipe").

usage: llama3_recipe.py TORCHRUN TRAIN [--rounds R] [--steps N] [--configs small large]
                        [--meshes 2x2x2 1x2x2 2x1x2x1 2x2x2x1] [--microbatches M]
Runs the same recipe alternately in dtensor (examples/train, the Llama 3 recipe) and in
PyTorch (this file run as a torchrun worker: the Llama 3 model of tools/torch_llama3.py,
parallelized with the pinned PyTorch's public API as torchtitan does it: tensor and sequence
parallelism with PrepareModuleInput and loss_parallel, checkpoint_wrapper per block,
fully_shard with bf16 parameters and fp32 reductions over (dp_replicate, dp_shard), AdamW,
clip_grad_norm_), built on the meta device. A mesh of four sizes is pp x dp_replicate x
dp_shard x tp: pipeline parallelism, 1F1B over 2 x pp microbatches (dtensor's default), each
stage torchtitan's split, tp 1 (PyTorch's PipelineStage with a Schedule1F1B; context
parallelism has no PyTorch counterpart on CPU ranks: its sharding strategies cover the CUDA
attention kernels only). Per run: the median step time of the steps after
the first few, tokens/s of the global batch, and the largest rank's peak resident memory
(VmHWM / ru_maxrss). Prints a markdown table: medians over rounds and their spread.
"""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {  # dim, layers, heads, kv_heads, seq, global batch
    "small": (64, 2, 4, 2, 32, 32),
    "large": (256, 4, 8, 4, 64, 32),
}
VOCAB = 128
WARMUP = 4


# ---------------------------------------------------------------------------------------
# The PyTorch side (a torchrun worker)
# ---------------------------------------------------------------------------------------

def torch_worker(cfg_name, mesh_shape, steps, out, microbatches):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import torch_llama3  # noqa: PLC0415

    dim, layers, heads, kv_heads, seq, batch = CONFIGS[cfg_name]
    torch.set_num_threads(1)
    pp = mesh_shape[0] if len(mesh_shape) == 4 else 1
    names = ("dp_replicate", "dp_shard", "tp")
    world = init_device_mesh("cpu", mesh_shape, mesh_dim_names=(("pp",) if pp > 1 else ()) + names)
    mesh = world[names] if pp > 1 else world
    dp = mesh["dp_replicate", "dp_shard"]
    stage_index = world.get_local_rank("pp") if pp > 1 else 0
    model = torch_llama3.build(mesh, dim, layers, heads, kv_heads, VOCAB,
                               torch_llama3.hidden_dim(dim, 32),
                               stage=(stage_index, pp) if pp > 1 else None)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = None
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: PLC0415
        stage = PipelineStage(model, stage_index, pp, torch.device("cpu"),
                              group=world.get_group("pp"))
        schedule = Schedule1F1B(stage, n_microbatches=microbatches or 2 * pp, loss_fn=lambda logits, y:
                                F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))
    ranks = dp.size()
    index = dp.get_local_rank("dp_replicate") * dp.size(1) + dp.get_local_rank("dp_shard")
    times = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(VOCAB, (batch, seq + 1), generator=g)
        rows = tokens[index * batch // ranks:(index + 1) * batch // ranks]
        x, y = rows[:, :-1], rows[:, 1:]
        t0 = time.perf_counter()
        opt.zero_grad()
        if schedule is not None:
            if stage_index == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
            # Every stage's parameters (torchtitan clips them together over the pp group).
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            norm = norm.full_tensor() ** 2
            torch.distributed.all_reduce(norm, group=world.get_group("pp"))
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm.sqrt())
        else:
            logits = model(x)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            for step, t in enumerate(times):
                f.write(json.dumps({"step": step, "step_s": t, "peak_resident_mib": peak.item()}) + "\n")
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------

ENV = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
           PYTHONWARNINGS="ignore")


def summary(path, batch, seq):
    rows = [json.loads(line) for line in open(path)]
    step = statistics.median(r["step_s"] for r in rows[WARMUP:])
    return step, batch * seq / step, max(r["peak_resident_mib"] for r in rows)


def run(side, args, cfg, mesh, tmp):
    dim, layers, heads, kv, seq, batch = CONFIGS[cfg]
    nproc = math.prod(int(x) for x in mesh.split("x"))
    out = os.path.join(tmp, f"{side}.jsonl")
    if side == "dtensor":
        sizes = mesh.split("x")
        layout = (["--pp", sizes[0], "--pp-schedule", "1F1B", "--mesh", "x".join(sizes[1:]),
                   "--microbatches", str(args.microbatches)]
                  if len(sizes) == 4 else ["--mesh", mesh])
        cmd = [args.torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", args.train,
               *layout, "--steps", str(args.steps), "--dim", str(dim), "--layers", str(layers),
               "--heads", str(heads), "--kv-heads", str(kv), "--seq", str(seq), "--batch", str(batch),
               "--vocab", str(VOCAB), "--log-every", "1000", "--metrics", out]
    else:
        cmd = [args.torchrun, "--standalone", f"--nproc-per-node={nproc}", os.path.abspath(__file__),
               "--worker", cfg, mesh, str(args.steps), out, str(args.microbatches)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=900)
    if p.returncode != 0 and side == "torch":
        sys.exit(f"{side} failed:\n{(p.stdout + p.stderr)[-4000:]}")
    return summary(out, batch, seq)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        cfg, mesh, steps, out, micro = sys.argv[2:7]
        torch_worker(cfg, tuple(int(x) for x in mesh.split("x")), int(steps), out, int(micro))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("torchrun")
    ap.add_argument("train")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--configs", nargs="+", default=["small", "large"])
    ap.add_argument("--microbatches", type=int, default=0,
                    help="pipeline microbatches per step (0: 2 x pp, dtensor's default)")
    ap.add_argument("--meshes", nargs="+", default=["2x2x2", "1x2x2", "2x1x2x1", "2x2x2x1"])
    args = ap.parse_args()
    print("| config (dim, layers, heads/kv, seq, batch) | mesh | dtensor step ms | PyTorch step ms "
          "| ratio | dtensor tokens/s | PyTorch tokens/s | dtensor peak MiB | PyTorch peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in args.configs:
            for mesh in args.meshes:
                res = {"dtensor": [], "torch": []}
                for r in range(args.rounds):
                    order = ("dtensor", "torch") if r % 2 == 0 else ("torch", "dtensor")
                    for side in order:
                        res[side].append(run(side, args, cfg, mesh, tmp))
                d, t = res["dtensor"], res["torch"]
                med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
                spread = lambda xs: f"{min(x[0] for x in xs) * 1e3:.0f}-{max(x[0] for x in xs) * 1e3:.0f}"  # noqa: E731
                dim, layers, heads, kv, seq, batch = CONFIGS[cfg]
                print(f"| {cfg} ({dim}, {layers}, {heads}/{kv}, {seq}, {batch}) | {mesh} "
                      f"| {med(d, 0) * 1e3:.1f} ({spread(d)}) | {med(t, 0) * 1e3:.1f} ({spread(t)}) "
                      f"| {med(d, 0) / med(t, 0):.2f}x | {med(d, 1):.0f} | {med(t, 1):.0f} "
                      f"| {med(d, 2):.0f} | {med(t, 2):.0f} |", flush=True)


if __name__ == "__main__":
    main()
