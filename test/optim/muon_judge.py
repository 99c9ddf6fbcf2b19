"""The judge of test_muon: PyTorch's own optimizers on one process.

Writes OUT (safetensors): for each configuration, the parameters before the first step
("init.<name>"), each step's gradients ("grad.<step>.<name>") and the parameters after the
last step ("<config>.<name>"), stepped by torch.optim.Muon (the matrices) and torch.optim.AdamW
(the rest: a vector, and an embedding-like matrix, as torchtitan and Moonlight split a model),
one thread, as the C++ test runs. torch.optim.Muon takes 2-D parameters only, so the 3-D
"experts" parameter is stepped as one 2-D parameter per expert (each [out, in] matrix on its
own), which is what dtensor's Muon does with a batch of matrices. The shapes include tall,
wide, square and odd ones (uneven over 4 and 8 ranks, one row per rank and empty shards).
"""
import sys

import torch
from safetensors.torch import save_file

SHAPES = {
    "wide": (8, 24),
    "tall": (24, 8),
    "square_a": (16, 16),
    "square_b": (16, 16),
    "odd": (10, 6),
    "experts": (4, 12, 8),
    "norm": (16,),
    "embed": (32, 8),
}
ADAMW = ("norm", "embed")
STEPS = 3
CONFIGS = {
    # torch.optim.Muon's defaults but the learning rate; AdamW as torchtitan's.
    "default": dict(muon=dict(lr=0.02), adamw=dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                                   weight_decay=0.1)),
    "variant": dict(muon=dict(lr=0.01, weight_decay=0.05, momentum=0.9, nesterov=False,
                              ns_steps=3, adjust_lr_fn="match_rms_adamw"),
                    adamw=dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0,
                               amsgrad=True)),
}


def main(out):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(20261204)
    init = {n: torch.randn(s, generator=g) * 0.5 for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(STEPS)]
    tensors = {f"init.{n}": t for n, t in init.items()}
    for k, step in enumerate(grads):
        tensors.update({f"grad.{k}.{n}": t for n, t in step.items()})
    for config, opts in CONFIGS.items():
        params = {n: t.clone() for n, t in init.items()}
        # One leaf per matrix: the 3-D parameter split by expert.
        leaves = {n: [torch.nn.Parameter(params[n][e].clone()) for e in range(SHAPES[n][0])]
                  if len(SHAPES[n]) == 3 else [torch.nn.Parameter(params[n])] for n in SHAPES}
        muon = torch.optim.Muon([p for n in SHAPES if n not in ADAMW for p in leaves[n]],
                                **opts["muon"])
        adamw = torch.optim.AdamW([p for n in ADAMW for p in leaves[n]], **opts["adamw"])
        for step in grads:
            for n, ps in leaves.items():
                for e, p in enumerate(ps):
                    p.grad = (step[n][e] if len(ps) > 1 else step[n]).clone()
            muon.step()
            adamw.step()
        for n, ps in leaves.items():
            tensors[f"{config}.{n}"] = (torch.stack([p.detach() for p in ps]) if len(ps) > 1
                                        else ps[0].detach()).contiguous()
    save_file(tensors, out)


if __name__ == "__main__":
    main(sys.argv[1])
