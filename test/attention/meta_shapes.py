"""The judge of test_attention_kernels' output shapes: PyTorch's meta kernels.

Writes, for every case the test runs, the shapes PyTorch's meta kernels (torch/_meta_registrations.py,
the venv's torch) give each output of the CUDA attention kernels, forward and backward. The
C++ test runs the same cases on DTensors through CPU analogues of the kernels and checks every
DTensor output's global shape against these.
"""
import json
import sys

import torch

aten = torch.ops.aten
# The CPU analogues take any shape: uneven ones (L != S, a value head dim of 6) check the
# shape rules. The real kernels on a GPU need aligned ones (head dims and, with a bias, S
# multiples of 8 / 16; a misaligned call faults on the device): "gpu_cases".
DIMS = {"cases": (4, 4, 6, 8, 8, 6), "gpu_cases": (4, 4, 16, 32, 16, 16)}


def shapes(results):
    return [list(r.shape) if isinstance(r, torch.Tensor) else None for r in results]


def meta(*shape):
    return torch.empty(*shape, device="meta")


def case(op, dims, bias, flag):
    B, H, L, S, E, ev = dims
    if op == "flash":
        ev = E
    q, k, v = meta(B, H, L, E), meta(B, H, S, E), meta(B, H, S, ev)
    b = meta(B, H, L, S) if bias else None
    if op == "efficient":
        fwd = aten._scaled_dot_product_efficient_attention(q, k, v, b, flag)
        g = meta(*fwd[0].shape)
        bwd = aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, b, fwd[0], fwd[1], fwd[2], fwd[3], 0.0, [True, True, True, bias])
    elif op == "flash":
        fwd = aten._scaled_dot_product_flash_attention(q, k, v, return_debug_mask=flag)
        g = meta(*fwd[0].shape)
        bwd = aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, fwd[0], fwd[1], fwd[2], fwd[3], fwd[4], fwd[5], 0.0, False, fwd[6], fwd[7])
    else:
        fwd = aten._scaled_dot_product_cudnn_attention(q, k, v, b, flag)
        g = meta(*fwd[0].shape)
        bwd = aten._scaled_dot_product_cudnn_attention_backward(
            g, q, k, v, fwd[0], fwd[1], fwd[6], fwd[7], b, fwd[2], fwd[3], fwd[4], fwd[5], 0.0, False)
    return {"op": op, "dims": [B, H, L, S, E, ev], "bias": bias, "flag": flag,
            "forward": shapes(fwd), "backward": shapes(bwd)}


out = {"torch": torch.__version__}
for name, dims in DIMS.items():
    cases = []
    for flag in (True, False):  # compute_log_sumexp (efficient, cuDNN) / return_debug_mask (flash)
        cases.append(case("flash", dims, False, flag))
        for bias in (True, False):
            cases.append(case("efficient", dims, bias, flag))
            cases.append(case("cudnn", dims, bias, flag))
    out[name] = cases
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
