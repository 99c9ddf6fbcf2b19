"""Generation tokens/s: dtensor's generator (bench/generate.cpp: the KV cache against full
recompute, as one tensor-parallel generator over 1, 2, 4 ranks) beside transformers' generate
on the same model (the Hugging Face folder bench_generate exports), the same prompts, greedy.

Usage:  python bench/generate.py TORCHRUN BENCH_BIN [--ranks 1 2 4] [--rounds 3]
                 [--dim 256] [--layers 4] [--heads 8] [--kv-heads 4] [--vocab 2048]
                 [--batch 4] [--prompt 32] [--new 64]

One thread a rank (and for transformers). Each configuration: --rounds rounds, the KV cache and
recompute alternating inside each; transformers' generate (use_cache True and False, the prompts
left-padded with their attention mask, as it batches them) in this process between dtensor's
runs. The table: new tokens/s per rank, median over rounds (min-max), and each row's ratio to
transformers' with its cache; the tokens of dtensor's runs and transformers' compared.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

from bench_util import torchrun_result  # bench/bench_util.py (this script's folder)


def hf_generate(torch, model, prompts, new, use_cache):
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, use_cache=use_cache, pad_token_id=0)
    ms = (time.perf_counter() - t0) * 1e3
    return ms, out[:, longest:].tolist()


def row(label, ms, tokens, ranks, reference):
    rate = [tokens / (m / 1e3) / ranks for m in ms]
    med = statistics.median(rate)
    ratio = f"{med / reference:.2f}x" if reference else "1.00x"
    print(f"| {label} | {ranks} | {med:.1f} ({min(rate):.1f}-{max(rate):.1f}) | {ratio} |")
    return med


def main():
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

    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    hf_dir = tempfile.mkdtemp(prefix="dtensor-bench-generate-")
    first = torchrun_result(a.torchrun, 1, ["--no-python", a.bench, *flags, "--rounds", "1",
                                            "--hf", hf_dir])
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    prompts = first["prompts"]
    hf_ms = {True: [], False: []}
    ours = {}
    for n in a.ranks:
        ours[n] = torchrun_result(a.torchrun, n, ["--no-python", a.bench, *flags,
                                                  "--rounds", str(a.rounds)])
        for cache in (True, False):
            ms, hf_tokens = hf_generate(torch, model, prompts, a.new, cache)
            hf_ms[cache].append(ms)
    new_tokens = a.batch * a.new
    print(f"Llama dim {a.dim}, {a.layers} layers, {a.heads} heads ({a.kv_heads} kv), vocab "
          f"{a.vocab}, fp32; {a.batch} prompts of {a.prompt // 2 + 1}-{a.prompt} tokens, "
          f"{a.new} new tokens each, greedy; one thread a rank\n")
    print("| generator | ranks | new tokens/s per rank | vs transformers (cache) |")
    print("| --- | ---: | ---: | ---: |")
    ref = row("transformers generate, KV cache", hf_ms[True], new_tokens, 1, None)
    row("transformers generate, recompute", hf_ms[False], new_tokens, 1, ref)
    for n in a.ranks:
        row("dtensor, KV cache", ours[n]["cached_ms"], new_tokens, n, ref)
        row("dtensor, recompute", ours[n]["recompute_ms"], new_tokens, n, ref)
    same = [ours[n]["tokens"] == hf_tokens for n in a.ranks]
    print(f"\ntokens equal to transformers': {same}; KV cache bytes per rank: "
          f"{[ours[n]['kv_bytes'] for n in a.ranks]}")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
