#!/usr/bin/env python3
"""The Llama-3 model's Hugging Face exchange, judged by transformers (meson test llama3_hf).

usage: hf_driver.py TORCHRUN WORKER [qwen3_moe | deepseek_v3 [TRAIN]]
  export  8 ranks (2x2x2: dp_replicate, dp_shard, tp) initialize the model and write it with
          export_hf in files of at most 64 KB (several, with their index and
          generation_config.json, each rank writing its own pieces); transformers'
          LlamaForCausalLM.from_pretrained loads the folder and its logits equal dtensor's
          (max abs difference <= 1e-4, fp32).
  load    a LlamaForCausalLM with random weights, saved by save_pretrained in several shards
          (max_shard_size 64 KB), loads through load_hf on 8 (2x2x2), 4 (2x1x2), 2 (1x2x1) and
          1 rank: logits equal transformers'. Every rank's allocations while loading stay within
          its share plus the largest file (the worker checks). The same saved in bfloat16 loads
          into the float32 model, converted as read.
  errors  a missing shard, a truncated shard, a config.json that does not match the weights
          and an unknown architecture: the job fails on both of its ranks with a message naming
          the file and the tensor, and writes nothing. A stale shard beside the files the
          index names is not read: the folder loads with transformers' logits.
With qwen3_moe, the tiny Qwen3-MoE (explicit head_dim, q / k norms, a dense layer then a
mixture of 8 experts, top 2) against Qwen3MoeForCausalLM, its experts one tensor each:
  export  4 ranks (1x4x1, experts over ep 4) write it in files of at most 64 KB; transformers
          loads it. And the dense
          Qwen3 (the tiny Llama with q / k norms) from 1x2x2 (tp 2), by Qwen3ForCausalLM.
  load    a Qwen3MoeForCausalLM saved by save_pretrained in several shards loads on 1, 2 (ep 2),
          4 (1x4x1, ep 2 x efsdp 2: each rank reads its experts' rows of the per-expert
          tensors) and 8 ranks (2x2x2, ep 4); a dense Qwen3ForCausalLM's on 1, 2 (tp 2), 4
          (dp_shard 2 x tp 2) and 8 (2x2x2).
With deepseek_v3, DeepSeek-V3 (multi-head latent attention with a q latent, YaRN's rotary
scaling, a dense layer then sigmoid-routed experts in groups with the correction bias and a
shared expert) against DeepseekV3ForCausalLM, saved by save_pretrained in several shards:
  load    on 1 rank, on 2 (dp_shard 2; tp 2 under torchtitan's plan for latent attention), on
          4 (dp_shard 4 with experts over ep 2 x efsdp 2; dp_shard 2 x tp 2 with ep 2) and on 8
          (dp_replicate 2 x dp_shard 2 x tp 2, ep 2):
          logits equal transformers'; the variant without a q latent (q_lora_rank None) on 2
          (dp_shard 2, and tp 2).
  export  the dp_shard 4 job exports what it loaded; DeepseekV3ForCausalLM loads the export
          and its logits equal the source's.
  float8  the folder as DeepSeek publishes its weights (each Linear weight in float8 with
          weight_scale_inv per block) loads on tp 2 and dp_shard 2 x tp 2 with ep 2 with the
          logits of transformers on the dequantized weights; a weight without its scales is
          refused by name.
  train   (with TRAIN, the recipe) 3 steps from the folder on tp 2, dp_shard 2 x tp 2 with ep
          2, cp 2 (ring), pp 2 (1F1B) and cp 2 x tp 2 with ep 2 against 1 rank: losses and
          gradient norms within
          1e-5 (the gradients of the replicated latent projections summed over tp by the
          DTensors; context parallelism's kernel in place of latent attention's).
Exits 0 when all hold.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # quiet transformers
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

TOL = 1e-4


def tokens(vocab):
    b = torch.arange(2).unsqueeze(1)
    s = torch.arange(8).unsqueeze(0)
    return (b * 31 + s * 7 + 3) % vocab


SHARD = 64 * 1024  # bytes: the tiny models' files come in several shards


def job(torchrun, worker, nproc, *argv, fails=False):
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", worker, *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if (p.returncode != 0) != fails:
        print((p.stdout + p.stderr)[-6000:])
        raise SystemExit(f"FAIL: {' '.join(argv)} on {nproc} ranks exited {p.returncode}")
    return p.stdout + p.stderr


def shards(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def check_folder(what, d, names):
    """A sharded Hugging Face folder: several files, the index naming every tensor's file."""
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    files = shards(d)
    ok = (len(files) > 1 and set(weight_map.values()) == set(files) and set(weight_map) == names
          and os.path.exists(os.path.join(d, "generation_config.json")))
    print(f"{'ok' if ok else 'FAIL'}: {what}: {len(files)} files, {len(weight_map)} tensors indexed")
    return ok


def refused(torchrun, worker, tmp, what, src, wants):
    """A load of `src` on 2 ranks fails on both, naming `wants`, and writes nothing."""
    out = os.path.join(tmp, "refused")
    text = job(torchrun, worker, 2, "load", src, out, "1x2x1", fails=True)
    lines = [l for l in text.splitlines() if l.startswith("llama3_hf_worker rank ")]
    ok = (len(lines) == 2 and all(all(w in l for w in wants) for l in lines)
          and not os.path.exists(out))
    print(f"{'ok' if ok else 'FAIL'}: {what}: {lines[0] if lines else text[-800:]}")
    return ok


def bad_folders(torchrun, worker, tmp, src):
    """A missing shard, a truncated one, a config.json the weights do not match, an unknown
    architecture: each refused by name on every rank."""
    good = True
    files = shards(src)

    def copy(name):
        d = os.path.join(tmp, name)
        shutil.copytree(src, d)
        return d

    d = copy("missing")
    os.remove(os.path.join(d, files[1]))
    good &= refused(torchrun, worker, tmp, "a missing shard", d, [files[1], "is missing"])
    d = copy("truncated")
    with open(os.path.join(d, files[0]), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, files[0])) - 100)
    good &= refused(torchrun, worker, tmp, "a truncated shard", d, [files[0], "truncated"])
    d = copy("mismatch")
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] = 192
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    good &= refused(torchrun, worker, tmp, "a config.json the weights do not match", d,
                    ["mlp.gate_proj.weight", "shape"])
    config["intermediate_size"], config["model_type"] = 160, "gpt2"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    good &= refused(torchrun, worker, tmp, "an unknown architecture", d, ["config.json", "'gpt2'"])
    return good


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


def saved_reference(model, tmp, **save):
    """`model` with its norms off one, saved by save_pretrained: (directory, its logits)."""
    model.eval()
    perturb_norms(model)
    src = os.path.join(tmp, "src")
    model.save_pretrained(src, **save)
    return src, hf_logits(model, model.config.vocab_size)


def qwen3_moe(torchrun, worker):
    good = True
    with tempfile.TemporaryDirectory() as tmp:
        hf, out = os.path.join(tmp, "hf"), os.path.join(tmp, "logits")
        job(torchrun, worker, 4, "export-qwen3-moe", hf, out, "1x4x1", "4", str(SHARD))
        model = Qwen3MoeForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
        good &= check("Qwen3-MoE export on 1x4x1 (ep 4), loaded by transformers", logits_of(out),
                      hf_logits(model, model.config.vocab_size))
        with open(os.path.join(hf, "model.safetensors.index.json")) as f:
            keys = json.load(f)["weight_map"]
        per_expert = sum(".mlp.experts." in k for k in keys)
        ok = per_expert == 3 * 8 and "model.layers.1.mlp.experts.7.down_proj.weight" in keys
        print(f"{'ok' if ok else 'FAIL'}: {per_expert} per-expert tensors (want 24), {len(shards(hf))} "
              f"files")
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
        src, want = saved_reference(Qwen3MoeForCausalLM(config), tmp, max_shard_size=SHARD)
        for nproc, shape, ep in ((1, "1x1x1", "1"), (2, "1x2x1", "2"), (4, "1x4x1", "2"),
                                 (8, "2x2x2", "4")):
            job(torchrun, worker, nproc, "load", src, out + "-load" + shape, shape, ep)
            good &= check(f"Qwen3-MoE save_pretrained loaded on {shape} (ep {ep})",
                          logits_of(out + "-load" + shape), want)

        torch.manual_seed(9)
        dense = Qwen3ForCausalLM(Qwen3Config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=16,
            rope_theta=1e6, tie_word_embeddings=False))
        src, want = saved_reference(dense, os.path.join(tmp, "dense"), max_shard_size=SHARD)
        for nproc, shape in ((1, "1x1x1"), (2, "1x1x2"), (4, "1x2x2"), (8, "2x2x2")):
            job(torchrun, worker, nproc, "load", src, out + "-dense" + shape, shape)
            good &= check(f"dense Qwen3 save_pretrained loaded on {shape}",
                          logits_of(out + "-dense" + shape), want)
    return good


def deepseek_v3_reference(tmp, name, q_lora):
    """A tiny DeepseekV3ForCausalLM (YaRN, norms off one, a non-zero correction bias) saved by
    save_pretrained in several shards: (directory, its logits)."""
    torch.manual_seed(3)
    config = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=q_lora, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(8))
    src = os.path.join(tmp, name)
    model.save_pretrained(src, max_shard_size=SHARD)
    return src, hf_logits(model, config.vocab_size)


FP8_BLOCK = (16, 32)  # rows, columns: kv_a_proj_with_mqa's 24 rows end in a partial block
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantized(name):
    """Whether DeepSeek-V3's published checkpoint stores `name` in float8: every Linear weight
    of attention and the MLPs, not the router, embeddings, norms or head."""
    return (name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")) and \
        ".layers." in name


def block_quantize(w):
    """DeepSeek's fine-grained float8: (q in float8_e4m3fn, scale_inv per FP8_BLOCK block)."""
    bm, bn = FP8_BLOCK
    m, n = w.shape
    rows, cols = -(-m // bm), -(-n // bn)
    padded = torch.zeros(rows * bm, cols * bn)
    padded[:m, :n] = w
    blocks = padded.view(rows, bm, cols, bn)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(rows * bm, cols * bn)[:m, :n]
    return q.to(torch.float8_e4m3fn), scale


def dequantize(q, scale):
    bm, bn = FP8_BLOCK
    s = scale.repeat_interleave(bm, 0)[:q.shape[0]].repeat_interleave(bn, 1)[:, :q.shape[1]]
    return q.to(torch.float32) * s


def deepseek_v3_fp8(tmp, src):
    """`src` as DeepSeek-V3 publishes its weights: each Linear weight in float8 with
    `weight_scale_inv` per block, config.json's quantization_config naming the blocks. The
    judge: transformers' model holding the dequantized weights (DeepSeek's weight_dequant).
    Returns (directory, logits)."""
    from safetensors.torch import save_file
    stored, plain = {}, {}
    for name, w in load_all(src).items():
        if quantized(name):
            q, scale = block_quantize(w.float())
            plain[name] = dequantize(q, scale)
            stored[name], stored[name + "_scale_inv"] = q, scale
        else:
            stored[name] = plain[name] = w
    judge = os.path.join(tmp, "dsv3-dequantized")
    os.makedirs(judge)
    save_file(plain, os.path.join(judge, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(src, "config.json"), judge)
    model = DeepseekV3ForCausalLM.from_pretrained(judge, torch_dtype=torch.float32).eval()
    d = os.path.join(tmp, "dsv3-fp8")
    os.makedirs(d)
    names = sorted(stored)
    files = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for f, keys in files.items():
        save_file({k: stored[k] for k in keys}, os.path.join(d, f), metadata={"format": "pt"})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: f for f, keys in files.items()
                                                  for k in keys}}, f)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d, hf_logits(model, config["vocab_size"])


def deepseek_v3_fp8_loads(torchrun, worker, tmp, src):
    """The float8 folder on tp 2 and on dp_shard 2 x tp 2 with ep 2 (each rank its blocks'
    scales), against transformers on the dequantized weights; a weight without its scales
    refused by name."""
    d, want = deepseek_v3_fp8(tmp, src)
    out = os.path.join(tmp, "logits-fp8")
    good = True
    for nproc, shape, ep in ((2, "1x1x2", "1"), (4, "1x2x2", "2")):
        job(torchrun, worker, nproc, "load", d, out + shape, shape, ep)
        good &= check(f"DeepSeek-V3's float8 block-quantized folder loaded on {shape} (ep {ep})",
                      logits_of(out + shape), want)
    bad = os.path.join(tmp, "fp8-no-scale")
    shutil.copytree(d, bad)
    name = "model.layers.0.self_attn.o_proj.weight"
    with open(os.path.join(bad, "model.safetensors.index.json")) as f:
        index = json.load(f)
    holder = os.path.join(bad, index["weight_map"].pop(name + "_scale_inv"))
    tensors = load_file(holder)
    del tensors[name + "_scale_inv"]
    from safetensors.torch import save_file
    save_file(tensors, holder, metadata={"format": "pt"})
    with open(os.path.join(bad, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    good &= refused(torchrun, worker, tmp, "a float8 weight without its scales", bad,
                    [name, "without its scales"])
    return good


def deepseek_v3(torchrun, worker, train=None):
    good = True
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits")
        src, want = deepseek_v3_reference(tmp, "dsv3", 32)
        good &= len(shards(src)) > 1
        for nproc, shape, ep in ((1, "1x1x1", "1"), (2, "1x2x1", "1"), (2, "1x1x2", "1"),
                                 (4, "1x4x1", "2"), (4, "1x2x2", "2"), (8, "2x2x2", "2")):
            mode = "load-export" if shape == "1x4x1" else "load"
            job(torchrun, worker, nproc, mode, src, out + shape, shape, ep, str(SHARD))
            good &= check(f"DeepseekV3ForCausalLM loaded on {shape} (ep {ep})",
                          logits_of(out + shape), want)
        exported = out + "1x4x1-hf"
        model = DeepseekV3ForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
        good &= check("its export from 1x4x1 (ep 2), loaded by transformers",
                      hf_logits(model, model.config.vocab_size), want)
        good &= check_folder("the export", exported, set(load_all(src)))
        good &= deepseek_v3_fp8_loads(torchrun, worker, tmp, src)
        if train:
            good &= deepseek_v3_training(torchrun, train, src, tmp)
        noq, want = deepseek_v3_reference(tmp, "dsv3-noq", None)
        for shape in ("1x2x1", "1x1x2"):
            job(torchrun, worker, 2, "load", noq, out + "-noq" + shape, shape)
            good &= check(f"DeepseekV3ForCausalLM without a q latent loaded on {shape}",
                          logits_of(out + "-noq" + shape), want)
    return good


def deepseek_v3_training(torchrun, train, src, tmp):
    """The recipe from the folder against one rank: tp 2, dp_shard 2 x tp 2 (ep 2), cp 2 (ring),
    pp 2, cp 2 (all-gather) x tp 2 x ep 2."""
    flags = ["--init-from-hf", src, "--precision", "fp32", "--seq", "16", "--batch", "8",
             "--steps", "3", "--log-every", "1", "--ac", "none"]

    def steps(nproc, *layout):
        metrics = os.path.join(tmp, f"metrics-{nproc}-{'-'.join(layout)}.jsonl")
        cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "--no-python", train,
               *flags, *layout, "--metrics", metrics]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        if p.returncode != 0:
            print((p.stdout + p.stderr)[-4000:])
            raise SystemExit(f"FAIL: the recipe on {layout} exited {p.returncode}")
        return [json.loads(line) for line in open(metrics)]

    want = steps(1, "--mesh", "1x1x1")
    good = True
    for nproc, layout in ((2, ("--mesh", "1x1x2")), (4, ("--mesh", "1x2x2", "--ep", "2")),
                          (2, ("--cp", "2", "--cp-method", "ring", "--dp-shard", "1",
                               "--tp", "1")),
                          (2, ("--pp", "2", "--mesh", "1x1x1")),
                          (4, ("--cp", "2", "--dp-shard", "1", "--tp", "2", "--ep", "2"))):
        got = steps(nproc, *layout)
        worst = max(abs(g[k] - w[k]) / abs(w[k]) for g, w in zip(got, want)
                    for k in ("loss", "grad_norm"))
        ok = len(got) == len(want) == 3 and worst <= 1e-5
        print(f"{'ok' if ok else 'FAIL'}: the recipe from the folder on {' '.join(layout)}: 3 "
              f"steps' losses and norms within {worst:.2g} (relative) of one rank's")
        good &= ok
    return good


def load_all(d):
    """Every tensor name of a folder's safetensors files."""
    names = {}
    for f in shards(d):
        names.update(load_file(os.path.join(d, f)))
    return names


def main():
    torchrun, worker = sys.argv[1:3]
    if sys.argv[3:] == ["qwen3_moe"]:
        sys.exit(0 if qwen3_moe(torchrun, worker) else 1)
    if sys.argv[3:4] == ["deepseek_v3"]:
        sys.exit(0 if deepseek_v3(torchrun, worker, *sys.argv[4:5]) else 1)
    good = True
    with tempfile.TemporaryDirectory() as tmp:
        hf, out = os.path.join(tmp, "hf"), os.path.join(tmp, "logits")
        job(torchrun, worker, 8, "export", hf, out, "2x2x2", "1", str(SHARD))
        model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
        good &= check("export on 2x2x2, loaded by transformers", logits_of(out),
                      hf_logits(model, model.config.vocab_size))
        good &= check_folder("export on 2x2x2", hf, set(model.state_dict()))

        torch.manual_seed(5)
        config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                             max_position_embeddings=16, rope_theta=10000.0,
                             tie_word_embeddings=False)
        reference = LlamaForCausalLM(config)
        src, want = saved_reference(reference, tmp, max_shard_size=SHARD)
        good &= check_folder("save_pretrained(max_shard_size=64 KB)", src,
                             set(reference.state_dict()))
        for nproc, shape in ((8, "2x2x2"), (4, "2x1x2"), (2, "1x2x1"), (1, "1x1x1")):
            job(torchrun, worker, nproc, "load", src, out + shape, shape)
            good &= check(f"save_pretrained loaded on {shape}", logits_of(out + shape), want)

        bf16 = os.path.join(tmp, "bf16")
        reference.to(torch.bfloat16).save_pretrained(bf16, max_shard_size=SHARD)
        theirs = LlamaForCausalLM.from_pretrained(bf16, torch_dtype=torch.float32).eval()
        job(torchrun, worker, 2, "load", bf16, out + "-bf16", "1x2x1")
        good &= check("a bfloat16 folder loaded into float32 on 1x2x1", logits_of(out + "-bf16"),
                      hf_logits(theirs, config.vocab_size))
        good &= bad_folders(torchrun, worker, tmp, src)

        stale = os.path.join(tmp, "stale")  # a shard of an earlier save the index does not name
        shutil.copytree(src, stale)
        shutil.copy(os.path.join(stale, shards(src)[0]),
                    os.path.join(stale, "model-00001-of-00099.safetensors"))
        job(torchrun, worker, 2, "load", stale, out + "-stale", "1x2x1")
        good &= check("a folder with a stale shard beside its index's, loaded on 1x2x1",
                      logits_of(out + "-stale"), want)
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
