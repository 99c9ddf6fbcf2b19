"""The judge of the planner's model shapes: transformers builds each model from its config on
the meta device and counts its parameters (test layout_planner; dtensor/layout_planner.h).

usage: shapes_judge.py OUT.json

Writes, per shape name, transformers' parameter count and the count of the parameters the
planner leaves out by name ([Note: the planner's shapes]: biases, attention sinks, q / k norms
and latent attention's norms, the router's correction bias), so that the test can ask for the
planner's count exactly and for the left-out share to stay under 0.1%.
"""
import json
import re
import sys

import torch
import transformers

LEFT_OUT = re.compile(r"bias|sinks|q_norm|k_norm|q_a_layernorm|kv_a_layernorm")

LLAMA = dict(num_key_value_heads=8, vocab_size=128256)
QWEN3 = dict(head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
             decoder_sparse_step=1, mlp_only_layers=[])
MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
           tie_word_embeddings=False)
CONFIGS = {
    "llama3-8b": transformers.LlamaConfig(hidden_size=4096, num_hidden_layers=32,
                                          num_attention_heads=32, intermediate_size=14336,
                                          **LLAMA),
    "llama3-70b": transformers.LlamaConfig(hidden_size=8192, num_hidden_layers=80,
                                           num_attention_heads=64, intermediate_size=28672,
                                           **LLAMA),
    "llama3-405b": transformers.LlamaConfig(hidden_size=16384, num_hidden_layers=126,
                                            num_attention_heads=128, intermediate_size=53248,
                                            **LLAMA),
    "qwen3-30b-a3b": transformers.Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48,
                                                 num_attention_heads=32, num_key_value_heads=4,
                                                 intermediate_size=6144,
                                                 moe_intermediate_size=768, **QWEN3),
    "qwen3-235b-a22b": transformers.Qwen3MoeConfig(hidden_size=4096, num_hidden_layers=94,
                                                   num_attention_heads=64, num_key_value_heads=4,
                                                   intermediate_size=12288,
                                                   moe_intermediate_size=1536, **QWEN3),
    "gpt-oss-120b": transformers.GptOssConfig(hidden_size=2880, num_hidden_layers=36,
                                              num_attention_heads=64, num_key_value_heads=8,
                                              head_dim=64, intermediate_size=2880,
                                              num_local_experts=128, num_experts_per_tok=4,
                                              vocab_size=201088),
    "deepseek-v3-16b": transformers.DeepseekV3Config(
        hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None,
        vocab_size=102400, n_group=1, topk_group=1, **MLA),
    "deepseek-v3": transformers.DeepseekV3Config(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, q_lora_rank=1536,
        vocab_size=129280, **MLA),
}


def main():
    out = {}
    for name, config in CONFIGS.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        total = left_out = 0
        for pname, p in model.named_parameters():
            total += p.numel()
            if LEFT_OUT.search(pname):
                left_out += p.numel()
        out[name] = {"total": total, "left_out": left_out}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
