#!/usr/bin/env python3
"""dtensor's float8 linears judged by torchao (meson test float8_torchao).

usage: torchao_judge.py TORCHRUN WORKER

The worker (test/float8/float8_worker.cpp) writes seeded inputs with dtensor's outputs and
gradients; here torchao's Float8Linear (convert_to_float8_training with the recipe's
Float8LinearConfig) computes the same products on the same tensors, on CPU, and each result
must be bit-equal (torch.equal): every recipe (tensorwise, rowwise, rowwise_with_gw_hp), fp32
with a bias and bf16 without, and a two-Linear module converted with torchtitan's filter (the
output projection left in high precision); and float8_grouped_mm (the MoE experts' products)
against torchao's fp8_grouped_mm (prototype.moe_training, torchtitan's Float8GroupedExperts) as
its autograd function computes them, with its own pure-torch quantizers (tensor_to_scale,
to_fp8_saturated, torch_to_float8_per_group_colwise, torch_to_3d_rowwise_float8_transpose_rhs)
and torch._scaled_mm per expert in place of torch._scaled_grouped_mm, which has no CPU kernel.
Also torchao's own accuracy bar: SQNR of each
float8 output against the high-precision linear >= 20 dB (its test_float8_linear's bound).
Exits 0 when all hold.
"""
import copy
import os
import subprocess
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_utils import compute_error  # noqa: E402

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def run_worker(torchrun, worker, out_dir):
    cmd = [torchrun, "--standalone", "--nproc-per-node=1", "--no-python", worker, out_dir]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        print((p.stdout + p.stderr)[-6000:])
        raise SystemExit(f"FAIL: the worker exited {p.returncode}")
    files = [f for f in os.listdir(out_dir) if f.endswith(".safetensors")]
    assert len(files) == 1, files
    return load_file(os.path.join(out_dir, files[0]))


def float8_module(module, recipe, module_filter_fn=None):
    return convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe),
                                      module_filter_fn=module_filter_fn)


def check(failures, what, ours, theirs):
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape or not torch.equal(ours, theirs):
        diff = (ours.float() - theirs.float()).abs().max().item() if ours.shape == theirs.shape else None
        failures.append(f"{what}: dtensor {ours.dtype} {tuple(ours.shape)} vs torchao "
                        f"{theirs.dtype} {tuple(theirs.shape)}, max abs diff {diff}")


def judge_linear(t, recipe, dtype, failures):
    key = f"{recipe}.{dtype}."
    x, w, g = t[key + "x"], t[key + "w"], t[key + "g"]
    b = t.get(key + "b")
    lin = torch.nn.Linear(x.shape[-1], w.shape[0], bias=b is not None, dtype=x.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    plain = copy.deepcopy(lin)
    model = float8_module(torch.nn.Sequential(lin), recipe)
    xi = x.clone().requires_grad_()
    y = model(xi)
    y.backward(g)
    check(failures, key + "y", t[key + "y"], y.detach())
    check(failures, key + "dx", t[key + "dx"], xi.grad)
    check(failures, key + "dw", t[key + "dw"], model[0].weight.grad)
    if b is not None:
        check(failures, key + "db", t[key + "db"], model[0].bias.grad)
    sqnr = compute_error(plain(x).detach().float(), t[key + "y"].float()).item()
    if sqnr < 20:
        failures.append(f"{key}y: SQNR {sqnr:.1f} dB against the high-precision linear, < 20")
    return sqnr


def judge_model(t, recipe, failures):
    key = f"model.{recipe}."
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(32, 64, bias=False))
    model.add_module("relu", torch.nn.ReLU())
    model.add_module("output", torch.nn.Linear(64, 10, bias=False))
    with torch.no_grad():
        model.proj.weight.copy_(t[key + "proj.weight"])
        model.output.weight.copy_(t[key + "output.weight"])

    def torchtitan_filter(mod, fqn):  # torchtitan's: not the output, dims multiples of 16
        return fqn != "output" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    model = float8_module(model, recipe, torchtitan_filter)
    assert type(model.output) is torch.nn.Linear and type(model.proj) is not torch.nn.Linear
    xi = t[key + "x"].clone().requires_grad_()
    y = model(xi)
    y.backward(t[key + "g"])
    check(failures, key + "y", t[key + "y"], y.detach())
    check(failures, key + "dx", t[key + "dx"], xi.grad)
    check(failures, key + "proj.grad", t[key + "proj.grad"], model.proj.weight.grad)
    check(failures, key + "output.grad", t[key + "output.grad"], model.output.weight.grad)


def grouped_reference(x, w, counts, g):
    """torchao's _Float8GroupedMM forward and backward (fp8_grouped_mm.py), per expert."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training.utils import (torch_to_3d_rowwise_float8_transpose_rhs,
                                                      torch_to_float8_per_group_colwise)
    e4m3 = torch.float8_e4m3fn
    out_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype  # rowwise kernels: bf16

    def rowwise(t, dim):
        s = tensor_to_scale(t, e4m3, scaling_granularity=ScalingGranularity.AXISWISE,
                            axiswise_dim=dim, round_scales_to_power_of_2=True)
        return to_fp8_saturated(t.to(torch.float32) * s, e4m3), s

    def mm(a, a_s, b, b_s):  # a row-major, b column-major, scales (rows, 1) and (1, cols)
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), a_s.reciprocal(),
                                b_s.reciprocal(), out_dtype=out_dtype,
                                use_fast_accum=True).to(x.dtype)

    offs = counts.cumsum(0)
    b_t = w.transpose(-2, -1)  # (E, K, N), column-major
    a8, a_s = rowwise(x, -1)
    b8, b_s = rowwise(b_t, -2)  # per expert and output feature, along K: (E, 1, N)
    g8, g_s = rowwise(g, -1)
    bb8, bb_s = torch_to_3d_rowwise_float8_transpose_rhs(b_t, e4m3, True)  # (E, N, K), (E, 1, K)
    y, dx, dw = [], [], torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:  # torchao's per-group quantizer fails on an empty group: one at a time
            rows = slice(start, end)
            y.append(mm(a8[rows], a_s[rows], b8[e], b_s[e]))
            dx.append(mm(g8[rows], g_s[rows], bb8[e], bb_s[e]))
            one = torch.tensor([end - start])
            gc8, gc_s = torch_to_float8_per_group_colwise(g[rows], one, e4m3, True)
            ac8, ac_s = torch_to_float8_per_group_colwise(x[rows], one, e4m3, True)
            dw[e] = mm(gc8.t(), gc_s.view(-1, 1), ac8, ac_s.view(1, -1))
        start = end
    return torch.cat(y), torch.cat(dx), dw


def judge_grouped(t, dtype, failures):
    key = f"grouped.{dtype}."
    x, w, counts, g = t[key + "x"], t[key + "w"], t[key + "counts"], t[key + "g"]
    y, dx, dw = grouped_reference(x, w, counts, g)
    check(failures, key + "y", t[key + "y"], y)
    check(failures, key + "dx", t[key + "dx"], dx)
    check(failures, key + "dw", t[key + "dw"], dw)
    hp = torch.cat([x[s:e].float() @ w[i].float().t() for i, (s, e) in
                    enumerate(zip([0] + counts.cumsum(0).tolist()[:-1], counts.cumsum(0).tolist()))
                    if e > s])
    sqnr = compute_error(hp, t[key + "y"].float()).item()
    if sqnr < 20:
        failures.append(f"{key}y: SQNR {sqnr:.1f} dB against the high-precision products, < 20")
    return sqnr


def main():
    torchrun, worker = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        t = run_worker(torchrun, worker, d)
    failures = []
    compared = 0
    for recipe in RECIPES:
        for dtype in ["float32", "bfloat16"]:
            sqnr = judge_linear(t, recipe, dtype, failures)
            print(f"{recipe} {dtype}: SQNR {sqnr:.1f} dB")
            compared += 1
        judge_model(t, recipe, failures)
        compared += 1
    for dtype in ["float32", "bfloat16"]:
        sqnr = judge_grouped(t, dtype, failures)
        print(f"grouped experts {dtype}: SQNR {sqnr:.1f} dB")
        compared += 1
    if failures:
        print("\n".join(failures))
        raise SystemExit(f"FAIL: {len(failures)} results differ from torchao's")
    print(f"OK: {compared} cases bit-equal to torchao's Float8Linear and fp8_grouped_mm")


if __name__ == "__main__":
    main()
