"""Generation tokens/s: dtensor's generator (bench/generate.cpp: the KV cache and full
recompute, one tensor-parallel generator over every rank) against PyTorch on the same ranks
and model: transformers' LlamaForCausalLM loaded from the Hugging Face folder bench_generate
exports, its decoder layers parallelized by PyTorch's parallelize_module (q / k / v / gate / up
column-wise, o / down row-wise; one rank: the plain model), transformers' generate. The same
prompts (left-padded with their attention mask for transformers, as it batches them), greedy.

Driver:  python bench/generate.py TORCHRUN BENCH_BIN [--ranks 1 2 4] [--rounds 3]
                 [--dim 256] [--layers 4] [--heads 8] [--kv-heads 4] [--vocab 2048]
                 [--batch 4] [--prompt 32] [--new 64]
Worker:  torchrun ... bench/generate.py --worker HF_DIR PROMPTS_JSON NEW   (PyTorch's side)

One thread a rank on both sides. For each rank count, --rounds rounds alternate PyTorch's
worker and dtensor's program (each a fresh torchrun, each timing the KV cache and recompute
once between barriers). The table: new tokens/s per rank, the median over rounds (min-max),
and dtensor's ratio to PyTorch's on the same ranks and mode; the tokens of every run against
PyTorch's one-rank run (transformers' own decode).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from bench_util import torchrun_result  # bench/bench_util.py (this script's folder)


def worker(hf_dir, prompts_json, new):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    if dist.get_world_size() > 1:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
    prompts = json.load(open(prompts_json))
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    result = {}
    for cache in (True, False):
        dist.barrier()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, use_cache=cache,
                             pad_token_id=0)
        dist.barrier()
        key = "cached" if cache else "recompute"
        result[key + "_ms"] = [(time.perf_counter() - t0) * 1e3]
        result[key + "_tokens"] = out[:, longest:].tolist()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def rate(ms, tokens, ranks):
    return [tokens / (m / 1e3) / ranks for m in ms]


def cell(values):
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("torchrun")
    p.add_argument("bench")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=3)
    model_flags = {"dim": 256, "layers": 4, "heads": 8, "kv-heads": 4, "vocab": 2048,
                   "batch": 4, "prompt": 32, "new": 64}
    for k, v in model_flags.items():
        p.add_argument(f"--{k}", type=int, default=v)
    a = p.parse_args()
    flags = []
    for k in model_flags:
        flags += [f"--{k}", str(getattr(a, k.replace("-", "_")))]
    work = tempfile.mkdtemp(prefix="dtensor-bench-generate-")
    hf_dir, prompts_json = os.path.join(work, "hf"), os.path.join(work, "prompts.json")
    first = torchrun_result(a.torchrun, 1, ["--no-python", a.bench, *flags, "--rounds", "1",
                                            "--hf", hf_dir])
    json.dump(first["prompts"], open(prompts_json, "w"))
    torch_argv = [os.path.abspath(__file__), "--worker", hf_dir, prompts_json, str(a.new)]
    new_tokens = a.batch * a.new
    print(f"Llama dim {a.dim}, {a.layers} layers, {a.heads} heads ({a.kv_heads} kv), vocab "
          f"{a.vocab}, fp32; {a.batch} prompts of {a.prompt // 2 + 1}-{a.prompt} tokens, "
          f"{a.new} new tokens each, greedy; one thread a rank\n")
    print("| ranks | mode | PyTorch tokens/s per rank | dtensor tokens/s per rank | ratio | "
          "dtensor KV cache bytes a rank |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    judge = None
    agree = []
    for n in a.ranks:
        runs = {"torch": [], "ours": []}
        for _ in range(a.rounds):
            runs["torch"].append(torchrun_result(a.torchrun, n, torch_argv))
            runs["ours"].append(torchrun_result(a.torchrun, n, ["--no-python", a.bench, *flags,
                                                                "--rounds", "1"]))
        if judge is None:
            judge = runs["torch"][0]["cached_tokens"]
        agree += [r["cached_tokens"] == judge and r["recompute_tokens"] == judge
                  for r in runs["torch"]]
        agree += [r["tokens"] == judge for r in runs["ours"]]
        for mode in ("cached", "recompute"):
            theirs = [rate(r[mode + "_ms"], new_tokens, n)[0] for r in runs["torch"]]
            ours = [rate(r[mode + "_ms"], new_tokens, n)[0] for r in runs["ours"]]
            ratios = [o / t for o, t in zip(ours, theirs)]
            label = "KV cache" if mode == "cached" else "recompute"
            kv = runs["ours"][0]["kv_bytes"] if mode == "cached" else 0
            print(f"| {n} | {label} | {cell(theirs)} | {cell(ours)} | "
                  f"{statistics.median(ratios):.2f}x | {kv} |", flush=True)
    print(f"\ntokens equal to transformers' one-rank decode in every run: {all(agree)}")
    return 0 if all(agree) else 1


if __name__ == "__main__":
    sys.exit(main())
