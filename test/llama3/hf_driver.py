#!/usr/bin/env python3
"""The Llama-3 model's Hugging Face exchange, judged by transformers (meson test llama3_hf).

usage: hf_driver.py TORCHRUN WORKER [qwen3_moe]
  export  8 ranks (2x2x2: dp_replicate, dp_shard, tp) initialize the model and write it with
          export_hf; transformers' LlamaForCausalLM.from_pretrained loads the directory and
          its logits equal dtensor's (max abs difference <= 1e-4, fp32).
  load    a LlamaForCausalLM with random weights, saved by save_pretrained, loads through
          load_hf on 8 (2x2x2), 4 (2x1x2) and 2 (1x2x1) ranks: logits equal transformers'.
With qwen3_moe, the tiny Qwen3-MoE (explicit head_dim, q / k norms, a dense layer then a
mixture of 8 experts, top 2) against Qwen3MoeForCausalLM, its experts one tensor each:
  export  4 ranks (1x4x1, experts over ep 4) write it; transformers loads it. And the dense
          Qwen3 (the tiny Llama with q / k norms) from 1x2x2 (tp 2), by Qwen3ForCausalLM.
  load    a Qwen3MoeForCausalLM saved by save_pretrained loads on 4 ranks (1x4x1, ep 2 x
          efsdp 2: each rank reads its experts' rows of the per-expert tensors).
Exits 0 when all hold.
"""
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # quiet transformers
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeConfig,  # noqa: E402
                          Qwen3MoeForCausalLM)

TOL = 1e-4


def tokens(vocab):
    b = torch.arange(2).unsqueeze(1)
    s = torch.arange(8).unsqueeze(0)
    return (b * 31 + s * 7 + 3) % vocab


def job(torchrun, worker, nproc, *argv):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", worker, *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        print((p.stdout + p.stderr)[-6000:])
        raise SystemExit(f"FAIL: {' '.join(argv)} on {nproc} ranks exited {p.returncode}")


def logits_of(d):
    files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    assert len(files) == 1, files
    return load_file(os.path.join(d, files[0]))["logits"]


def hf_logits(model, vocab):
    with torch.no_grad():
        return model(tokens(vocab)).logits


def check(what, ours, theirs):
    diff = (ours - theirs).abs().max().item()
    ok = ours.shape == theirs.shape and diff <= TOL
    print(f"{'ok' if ok else 'FAIL'}: {what}: max abs difference {diff:.3g} (shape {tuple(ours.shape)})")
    return ok


def perturb_norms(model):
    with torch.no_grad():  # default init leaves norms at one: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def saved_reference(model, tmp):
    """`model` with its norms off one, saved by save_pretrained: (directory, its logits)."""
    model.eval()
    perturb_norms(model)
    src = os.path.join(tmp, "src")
    model.save_pretrained(src)
    return src, hf_logits(model, model.config.vocab_size)


def qwen3_moe(torchrun, worker):
    good = True
    with tempfile.TemporaryDirectory() as tmp:
        hf, out = os.path.join(tmp, "hf"), os.path.join(tmp, "logits")
        job(torchrun, worker, 4, "export-qwen3-moe", hf, out, "1x4x1", "4")
        files = sorted(os.listdir(hf))
        model = Qwen3MoeForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
        good &= check("Qwen3-MoE export on 1x4x1 (ep 4), loaded by transformers", logits_of(out),
                      hf_logits(model, model.config.vocab_size))
        with open(os.path.join(hf, "model.safetensors.index.json")) as f:
            keys = json.load(f)["weight_map"]
        per_expert = sum(".mlp.experts." in k for k in keys)
        ok = per_expert == 3 * 8 and "model.layers.1.mlp.experts.7.down_proj.weight" in keys
        print(f"{'ok' if ok else 'FAIL'}: {per_expert} per-expert tensors (want 24), files {files}")
        good &= ok

        job(torchrun, worker, 4, "export-qwen3", hf + "-dense", out + "-dense", "1x2x2")
        dense = Qwen3ForCausalLM.from_pretrained(hf + "-dense", torch_dtype=torch.float32).eval()
        good &= check("dense Qwen3 (q / k norms) export on 1x2x2 (tp 2), loaded by transformers",
                      logits_of(out + "-dense"), hf_logits(dense, dense.config.vocab_size))

        torch.manual_seed(7)
        config = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, mlp_only_layers=[0], vocab_size=256,
                                max_position_embeddings=16, rope_theta=1e6,
                                tie_word_embeddings=False)
        src, want = saved_reference(Qwen3MoeForCausalLM(config), tmp)
        job(torchrun, worker, 4, "load", src, out + "-load", "1x4x1", "2")
        good &= check("Qwen3-MoE save_pretrained loaded on 1x4x1 (ep 2 x efsdp 2)",
                      logits_of(out + "-load"), want)
    return good


def main():
    torchrun, worker = sys.argv[1:3]
    if sys.argv[3:] == ["qwen3_moe"]:
        sys.exit(0 if qwen3_moe(torchrun, worker) else 1)
    good = True
    with tempfile.TemporaryDirectory() as tmp:
        hf, out = os.path.join(tmp, "hf"), os.path.join(tmp, "logits")
        job(torchrun, worker, 8, "export", hf, out, "2x2x2")
        model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
        good &= check("export on 2x2x2, loaded by transformers", logits_of(out),
                      hf_logits(model, model.config.vocab_size))

        torch.manual_seed(5)
        config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                             max_position_embeddings=16, rope_theta=10000.0,
                             tie_word_embeddings=False)
        src, want = saved_reference(LlamaForCausalLM(config), tmp)
        for nproc, shape in ((8, "2x2x2"), (4, "2x1x2"), (2, "1x2x1")):
            job(torchrun, worker, nproc, "load", src, out + shape, shape)
            good &= check(f"save_pretrained loaded on {shape}", logits_of(out + shape), want)
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
