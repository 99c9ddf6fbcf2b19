#!/usr/bin/env python3
"""The Llama-3 model's Hugging Face exchange, judged by transformers (meson test llama3_hf).

usage: hf_driver.py TORCHRUN WORKER
  export  8 ranks (2x2x2: dp_replicate, dp_shard, tp) initialize the model and write it with
          export_hf; transformers' LlamaForCausalLM.from_pretrained loads the directory and
          its logits equal dtensor's (max abs difference <= 1e-4, fp32).
  load    a LlamaForCausalLM with random weights, saved by save_pretrained, loads through
          load_hf on 8 (2x2x2), 4 (2x1x2) and 2 (1x2x1) ranks: logits equal transformers'.
Exits 0 when all hold.
"""
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # quiet transformers
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

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


def main():
    torchrun, worker = sys.argv[1:3]
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
        ref = LlamaForCausalLM(config).eval()
        with torch.no_grad():  # default init leaves norms at one: make them count
            for name, p in ref.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        src = os.path.join(tmp, "src")
        ref.save_pretrained(src)
        want = hf_logits(ref, 256)
        for nproc, shape in ((8, "2x2x2"), (4, "2x1x2"), (2, "1x2x1")):
            job(torchrun, worker, nproc, "load", src, out + shape, shape)
            good &= check(f"save_pretrained loaded on {shape}", logits_of(out + shape), want)
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
