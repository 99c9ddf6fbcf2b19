#!/usr/bin/env python3
"""PyTorch's own estimate of one rank's training memory, as torchtitan's memory estimation
makes it: a fake process group (torch.testing's FakeStore, backend "fake") of WORLD ranks, the
model of tools/torch_llama3.py built on meta and parallelized on MESH, materialized under
FakeTensorMode, and two steps (forward, backward, AdamW) run under FSDPMemTracker, which
attributes every fake allocation to parameters, gradients, optimizer state and activations.
The judge of dtensor's simulated reports (docs/simulation.md "Against PyTorch").

usage: torch_estimate.py --model llama3-8b|llama3-70b|DIM,LAYERS,HEADS,KV,VOCAB,HIDDEN
                         --mesh AxBxC --rank R --batch B --seq S
Prints one JSON line: parameter, gradient and optimizer bytes of this rank's shards (counted
from the tensors), FSDPMemTracker's peak by category, the wall time.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_llama3  # noqa: E402


def local_bytes(t):
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--batch", type=int, required=True, help="global batch")
    ap.add_argument("--seq", type=int, required=True)
    a = ap.parse_args()
    if a.model in torch_llama3.PRESETS:
        dim, layers, heads, kv, vocab, multiple_of, mult = torch_llama3.PRESETS[a.model]
        hidden = torch_llama3.hidden_dim(dim, multiple_of, mult)
    else:
        dim, layers, heads, kv, vocab, hidden = (int(x) for x in a.model.split(","))
    shape = tuple(int(x) for x in a.mesh.split("x"))
    world = math.prod(shape)
    t0 = time.time()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=a.rank, world_size=world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dp = shape[0] * shape[1]
    model = torch_llama3.build(mesh, dim, layers, heads, kv, vocab, hidden)  # on meta
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        tokens = torch.randint(vocab, (a.batch // dp, a.seq + 1))
        tracker = FSDPMemTracker(mod=model, optm=opt)
        tracker.track_inputs((tokens,))
        with tracker:
            for step in range(2):
                x, y = tokens[:, :-1], tokens[:, 1:]
                logits = model(x)
                with loss_parallel():
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                             y.flatten())
                    loss.backward()
                opt.step()
                if step == 0:
                    tracker.reset_mod_stats()
                else:
                    params = sum(local_bytes(p) for p in model.parameters())
                    grads = sum(local_bytes(p.grad) for p in model.parameters())
                opt.zero_grad()
        optim = sum(local_bytes(v) for s in opt.state.values() for k, v in s.items()
                    if torch.is_tensor(v) and k != "step")
        peak = {}
        for dev, by_type in tracker.get_tracker_snapshot("peak").items():
            for k, v in by_type.items():
                peak[str(k)] = peak.get(str(k), 0) + v
    print(json.dumps({"rank": a.rank, "world_size": world, "parameter_bytes": params,
                      "gradient_bytes": grads, "optimizer_bytes": optim, "tracker_peak": peak,
                      "seconds": round(time.time() - t0, 1)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
