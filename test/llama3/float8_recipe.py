#!/usr/bin/env python3
"""The recipe trains in float8 as it does in bf16 (meson test train_float8-w8).

usage: float8_recipe.py TORCHRUN TRAIN OUTDIR
Runs examples/train on 8 ranks (2x2x2: HSDP x TP, bf16 parameters, full AC) for 20 steps of a
global batch of 16 rows, once as it is and once with --float8 rowwise (every block Linear in
float8, the output layer not): the same data, the same initial values. Passes when the float8
run's loss falls (the last step's below two thirds of the first's; measured 0.59) and every
step's loss is within BOUND (relative) of the bf16 run's: float8 changes the products' rounding,
not what is learned. Measured: 0.12% at most (docs/float8.md).

[Note: float8 on CPU] ATen's CPU _scaled_mm runs oneDNN's reference matmul, about 1,000 times
slower than its bf16 product, whenever a scale is one number (tensorwise, and rowwise without
fast accumulation, which applies the row scales after the product as torchao does): the float8
run costs about 5 times the bf16 one here, so the job is as small as still shows the loss
falling with float8's rounding.
"""
import os
import sys

from recipe_runs import run as run_recipe

STEPS = 20
BOUND = 0.03
FLAGS = ["--steps", str(STEPS), "--batch", "16", "--log-every", "5"]


def main():
    torchrun, train, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    bf16 = run_recipe(torchrun, train, 8, out, FLAGS, [])[0]
    fp8 = run_recipe(torchrun, train, 8, out, FLAGS, ["--float8", "rowwise"])[0]
    ok = len(fp8) == len(bf16) == STEPS
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(fp8, bf16))
    falls = fp8[-1]["loss"] < fp8[0]["loss"] * 2 / 3
    print(f"float8 rowwise: loss {fp8[0]['loss']:.4f} -> {fp8[-1]['loss']:.4f}; bf16 "
          f"{bf16[0]['loss']:.4f} -> {bf16[-1]['loss']:.4f}; largest step difference "
          f"{100 * worst:.2f}% (bound {100 * BOUND:.0f}%)")
    # The float8 products add amax all-reduces over tp and nothing else.
    extra = {k: fp8[-1]["collectives"][k] - bf16[-1]["collectives"][k]
             for k in bf16[-1]["collectives"]}
    print(f"collectives per step beyond bf16's: {extra}")
    ok = ok and falls and worst <= BOUND and extra.get("all_reduce", 0) > 0 and all(
        v == 0 for k, v in extra.items() if k != "all_reduce")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
