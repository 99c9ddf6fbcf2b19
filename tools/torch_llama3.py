"""Llama 3 written with PyTorch's public API, parallelized as torchtitan does it: the PyTorch
side of bench/llama3_recipe.py (step time) and of tools/torch_estimate.py (memory under a fake
process group). Tensor and sequence parallelism with PrepareModuleInput and a vocab-parallel
output, checkpoint_wrapper per block (full activation checkpointing), fully_shard with bf16
parameters and fp32 reductions over (dp_replicate, dp_shard) on torchtitan's units
(tok_embeddings, each block, [norm, output], the root): the layout of examples/train
(models/llama3.h). A pipeline stage (build's `stage`) is torchtitan's split: consecutive
blocks, the embeddings on the first stage, norm and output on the last.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {  # torchtitan's flavors: dim, layers, heads, kv_heads, vocab, multiple_of, multiplier
    "llama3-8b": (4096, 32, 32, 8, 128256, 1024, 1.3),
    "llama3-70b": (8192, 80, 64, 8, 128256, 4096, 1.3),
}


def hidden_dim(dim, multiple_of, multiplier=None):
    """torchtitan's FeedForward width."""
    h = int(2 * 4 * dim / 3)
    if multiplier:
        h = int(multiplier * h)
    return multiple_of * math.ceil(h / multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rotate(x, cos, sin):  # interleaved pairs, real arithmetic
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    return torch.stack((re * cos - im * sin, re * sin + im * cos), -1).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        bs, n = x.shape[:2]
        q = rotate(self.wq(x).view(bs, n, -1, self.head_dim), cos, sin)
        k = rotate(self.wk(x).view(bs, n, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(bs, n, -1, self.head_dim)
        rep = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).contiguous().view(bs, n, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.attention = Attention(dim, heads, kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, dim, layers, heads, kv_heads, vocab, hidden):
        super().__init__()
        self.head_dim = dim // heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        # A stage without the embeddings takes hidden states (whole sequences: tp 1 under pp).
        hd = self.head_dim
        freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=tokens.device).float() / hd))
        angles = torch.outer(torch.arange(tokens.shape[1], device=tokens.device).float(), freqs)
        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)) if self.output is not None else h


def split_stage(model, stage, stages):
    """torchtitan's pipeline split of `model` in place: stage `stage` of `stages` keeps its
    consecutive blocks (the first ones one more when they do not divide), the embeddings on
    the first stage and norm / output on the last."""
    n = len(model.layers)
    base, extra = divmod(n, stages)
    first = stage * base + min(stage, extra)
    last = first + base + (1 if stage < extra else 0)
    model.layers = nn.ModuleList(list(model.layers)[first:last])
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm = None
        model.output = None
    return model


def build(mesh, dim, layers, heads, kv_heads, vocab, hidden, stage=None):
    """The model on the meta device, parallelized on `mesh` (dp_replicate, dp_shard, tp); with
    `stage` = (index, count) only that pipeline stage of it, without tensor parallelism (tp 1),
    its units not resharded after forward (torchtitan's choice under pp)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    tp, dp = mesh["tp"], mesh["dp_replicate", "dp_shard"]
    with torch.device("meta"):
        model = Llama(dim, layers, heads, kv_heads, vocab, hidden)
    if stage is not None:
        assert tp.size() == 1, "a pipeline stage here is built without tensor parallelism"
        split_stage(model, *stage)
    else:
        parallelize_module(model, tp, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                      use_local_output=False),
        })
    for i, block in enumerate(model.layers):
        if stage is None:
            parallelize_module(block, tp, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
        model.layers[i] = checkpoint_wrapper(block)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = dict(mesh=dp, mp_policy=mp, reshard_after_forward=stage is None)
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **options)
    for block in model.layers:
        fully_shard(block, **options)
    if model.output is not None:  # used last in forward: kept for backward, as torchtitan
        fully_shard([model.norm, model.output], **dict(options, reshard_after_forward=False))
    fully_shard(model, **options)
    return model
