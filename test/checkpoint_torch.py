#!/usr/bin/env python3
"""PyTorch's side of the checkpoint interop test (test/checkpoint_driver.py), run by torchrun.

usage: checkpoint_torch.py write|read DIR
  write: MLPStack(16) and the toy Transformer under FSDP2 (fully_shard per block + root),
         one AdamW step, saved with dcp.save(..., HuggingFaceStorageWriter(save_distributed=True))
         to DIR/pt_<model>, their full values (rank 0, torch.save) to DIR/pt_<model>.ref.pt.
  read:  the same models under FSDP2, dcp.load(..., HuggingFaceStorageReader(DIR/dt_<model>))
         of what dtensor wrote, every tensor compared with DIR/dt_<model>.ref.pt; and
         dtensor's consolidated DIR/dt_<model>_hf read with safetensors.torch.load_file (as an
         inference user would), its index's weight_map checked, every weight compared.
The state dict is the model's plus the optimizer's flattened tensors (state.<fqn>.<field>);
the hyperparameters are plain Python numbers, which the safetensors writer cannot hold.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.testing._internal.common_fsdp import MLPStack
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

ARGS = dict(n_layers=2, vocab_size=8, max_seq_len=16, dim=16, n_heads=4, dropout_p=0.0,
            weight_tying=False)


def build(name):
    torch.manual_seed(0)
    model = MLPStack(16) if name == "mlp" else Transformer(ModelArgs(**ARGS))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in (list(model) if name == "mlp" else list(model.layers)):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def loss_of(model, name):
    if name == "mlp":
        return model(torch.randn(4, 16)).pow(2).mean()
    return model(torch.randint(0, 8, (2, 8))).pow(2).mean()


def state_of(model, opt):
    sd = dict(get_model_state_dict(model))
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd.update({k: v for k, v in osd.items() if isinstance(v, torch.Tensor)})
    return sd


def check_consolidated(path, ref, model):
    import json
    from safetensors.torch import load_file
    weights = load_file(os.path.join(path, "model-00001-of-00001.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    names = set(model.state_dict().keys())
    ok = set(weights) == names and set(index["weight_map"]) == names
    ok = ok and index["metadata"]["total_size"] == sum(w.numel() * w.element_size() for w in weights.values())
    for k, w in weights.items():
        ok = ok and torch.equal(w, ref[k])
    if not ok:
        print(f"consolidated {path}: names {sorted(set(weights) ^ names)} differ or values differ")
    return ok


def full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


def main():
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    ok = True
    for name in ("mlp", "transformer"):
        model = build(name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if mode == "write":
            torch.manual_seed(5 + dist.get_rank())
            loss_of(model, name).backward()
            opt.step()
            sd = state_of(model, opt)
            path = os.path.join(out, f"pt_{name}")
            dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))
            ref = {k: full(v).detach().clone() for k, v in sd.items()}
            if dist.get_rank() == 0:
                torch.save(ref, path + ".ref.pt")
            continue
        sd = state_of(model, opt)
        path = os.path.join(out, f"dt_{name}")
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(path))
        ref = torch.load(path + ".ref.pt", weights_only=False)
        for k, v in sd.items():
            want = ref[k]
            got = full(v).detach()
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                print(f"rank {dist.get_rank()}: {name} {k}: PyTorch loaded {got} but dtensor saved {want}")
                ok = False
        print(f"rank {dist.get_rank()}: PyTorch loaded dtensor's {name}: {len(sd)} tensors "
              f"{'equal' if ok else 'DIFFER'}")
        ok = check_consolidated(path + "_hf", ref, model) and ok
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
