"""The judge of test_generate's Hugging Face case, run at build time: a tiny Llama and a tiny
Qwen3 written by transformers (save_pretrained) and transformers' own generate on a batch of
prompts of different lengths (left-padded with their attention mask, as transformers batches
them), greedy and sampled (temperature 0.8, top-p 0.9, top-k off, torch.manual_seed(5)), eos 2.

Usage: python generate_judge.py OUT.json   (the tokens; the folders beside it: OUT.json.d/llama,
OUT.json.d/qwen3)
"""
import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

PROMPTS_SEED, NEW, EOS = 3, 8, 2


def weights(model):
    # Logits spread well apart (transformers' std 0.02 init would leave near ties that float
    # rounding could flip): matrices ~ N(0, 1 / fan_in), the embeddings N(0, 1), norms 1.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)


def decode(model, prompts, sample):
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    extra = dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=0) if sample else \
        dict(do_sample=False)
    torch.manual_seed(5)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                         eos_token_id=EOS, pad_token_id=0, **extra)[:, longest:].tolist()
    rows = []
    for row in out:  # up to and including eos (transformers pads a finished row after it)
        rows.append(row[:row.index(EOS) + 1] if EOS in row else row)
    return rows


def main():
    out_json = sys.argv[1]
    out = out_json + ".d"
    torch.manual_seed(PROMPTS_SEED)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (5, 2, 9)]
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    models = {"llama": LlamaForCausalLM(LlamaConfig(**common)),
              "qwen3": Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))}
    expected = {"prompts": prompts, "eos": EOS, "new": NEW}
    for name, model in models.items():
        weights(model)
        model.eval()
        model.save_pretrained(os.path.join(out, name))
        expected[name] = {"greedy": decode(model, prompts, False),
                          "sampled": decode(model, prompts, True)}
    with open(out_json, "w") as f:
        json.dump(expected, f)


if __name__ == "__main__":
    main()
