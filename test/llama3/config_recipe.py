#!/usr/bin/env python3
"""The recipe's TOML job files (meson test config_recipe).

usage: config_recipe.py TORCHRUN TRAIN CONFIGS OUTDIR
- configs/debug_model.toml with --steps 3 --tp 2 --dp-replicate 1 on 2 ranks, and the same run
  spelled as flags only (--mesh 1x1x2 and every key's flag): every step's loss and gradient
  norm equal, bit for bit, and the same collectives (the file and the flags are one run).
- torchtitan's overrides: `--training.steps=3 --parallelism.tensor_parallel_degree 2 ...`
  give the same run as the flags, bit for bit.
- A job file written for torchtitan (sections and keys this recipe does not implement) loads
  with one warning naming those keys, and trains; with checkpoint.enable false its
  [checkpoint] keys take no effect (nothing written), with true the checkpoint lands in
  job.dump_folder / checkpoint.folder.
- Determinism: debug.deterministic with the same debug.seed twice gives bit-equal losses;
  another seed other ones.
- Refusals, each naming the file and the key, before anything runs (exit 2): an unknown key
  (with the section's known keys), a value of the wrong type, a value outside the flag's
  choices, a TOML syntax error (with its line), an unknown `--section.key`, keep_latest_k 1,
  a layer-frequency selective_ac_option, a reduction dtype other than float32.
"""
import os
import shutil
import subprocess
import sys

from recipe_runs import launch, run as run_recipe

FLAGS = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "128",
         "--lr", "3e-3", "--seq", "32", "--batch", "32", "--max-norm", "1.0",
         "--precision", "bf16", "--ac", "full", "--log-every", "1"]


# A job file as torchtitan's users write them (its debug job's sections), on a small model.
TORCHTITAN_JOB = """
[job]
dump_folder = "{dump}"
description = "Llama 3 debug training"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"

[metrics]
log_freq = 1
enable_tensorboard = false

[model]
name = "llama3"
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
vocab_size = 128

[optimizer]
name = "AdamW"
lr = 3e-3
eps = 1e-8

[lr_scheduler]
warmup_steps = 1
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0

[training]
seq_len = 32
global_batch_size = 8
max_norm = 1.0
steps = 2
mixed_precision_param = "float32"
mixed_precision_reduce = "float32"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1

[checkpoint]
enable = {enable}
folder = "checkpoint"
interval = 10
async_mode = "disabled"

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"

[compile]
enable = false
components = ["model", "loss"]
"""
IGNORED = ["job.description", "job.print_config", "profiling.enable_profiling",
           "profiling.save_traces_folder", "metrics.enable_tensorboard", "model.name",
           "parallelism.fsdp_reshard_after_forward", "compile.enable", "compile.components"]


def torchtitan_job(torchrun, train, out, enable):
    dump = os.path.join(out, f"tt-{enable}")
    shutil.rmtree(dump, ignore_errors=True)  # no checkpoint of an earlier run to resume
    path = dump + ".toml"
    with open(path, "w") as f:
        f.write(TORCHTITAN_JOB.format(dump=dump, enable=enable))
    p = launch(torchrun, train, 2, ["--config", path, "--metrics", dump + ".jsonl"])
    warnings = [line for line in p.stderr.splitlines() if "warning:" in line]
    step_dir = os.path.join(dump, "checkpoint", "step-2")
    ok = (p.returncode == 0 and len(warnings) == 1 and all(k in warnings[0] for k in IGNORED)
          and os.path.isdir(step_dir) == (enable == "true"))
    print(f"{'ok' if ok else 'FAIL'} torchtitan's job file, checkpoint.enable {enable}: exit "
          f"{p.returncode}, warnings {warnings}, {step_dir} "
          f"{'written' if os.path.isdir(step_dir) else 'absent'}")
    if p.returncode != 0:
        print(p.stderr[-3000:])
    return ok


def refused(train, out, name, text, wants, extra=()):
    path = os.path.join(out, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    p = subprocess.run([train, "--config", path, *extra], capture_output=True, text=True,
                       timeout=60)
    ok = p.returncode == 2 and all(w in p.stderr for w in wants)
    print(f"{'ok' if ok else 'FAIL'} {name}: exit {p.returncode}: {p.stderr.splitlines()[:1]}")
    return ok


def main():
    torchrun, train, configs, out = sys.argv[1:5]
    os.makedirs(out, exist_ok=True)
    debug = os.path.join(configs, "debug_model.toml")
    steps = ["--steps", "3"]
    a = run_recipe(torchrun, train, 2, out, ["--config", debug, "--tp", "2", "--dp-replicate",
                                             "1", "--log-every", "1"], steps)[0]
    b = run_recipe(torchrun, train, 2, out, FLAGS + ["--mesh", "1x1x2"], steps)[0]
    same = len(a) == len(b) == 3 and all(
        x[k] == y[k] for x, y in zip(a, b) for k in ("loss", "grad_norm", "collectives"))
    print(f"{'ok' if same else 'FAIL'} file and flags: losses {[r['loss'] for r in a]} "
          f"against {[r['loss'] for r in b]}")
    ok = same
    c = run_recipe(torchrun, train, 2, out, ["--config", debug, "--parallelism.tensor_parallel_degree",
                                             "2", "--parallelism.data_parallel_replicate_degree=1",
                                             "--metrics.log_freq", "1"], ["--training.steps=3"])[0]
    same = len(c) == 3 and all(x[k] == y[k] for x, y in zip(a, c)
                               for k in ("loss", "grad_norm", "collectives"))
    print(f"{'ok' if same else 'FAIL'} torchtitan's overrides: losses {[r['loss'] for r in c]}")
    ok &= same
    ok &= torchtitan_job(torchrun, train, out, "false")
    ok &= torchtitan_job(torchrun, train, out, "true")
    seeded = [run_recipe(torchrun, train, 2, out, ["--debug.deterministic", "--log-every", "1"],
                         ["--steps", "3", "--debug.seed", seed])[0] for seed in ("7", "7", "8")]
    losses = [[r["loss"] for r in runs] for runs in seeded]
    same = losses[0] == losses[1] and losses[0][0] != losses[2][0]
    print(f"{'ok' if same else 'FAIL'} deterministic, seed 7 twice and 8: {losses}")
    ok &= same
    ok &= refused(train, out, "unknown_key", "[training]\nstepz = 3\n",
                  ["unknown_key.toml: training.stepz: unknown key", "training.steps"])
    ok &= refused(train, out, "wrong_type", "[training]\nsteps = \"three\"\n",
                  ["training.steps: expected an integer, got a string"])
    ok &= refused(train, out, "bad_choice", "[activation_checkpoint]\nmode = \"half\"\n",
                  ["activation_checkpoint.mode", "--ac takes full|selective|none"])
    ok &= refused(train, out, "bad_precision", "[training]\nmixed_precision_param = \"fp8\"\n",
                  ["training.mixed_precision_param: \"fp8\" is not one of \"bfloat16\""])
    ok &= refused(train, out, "syntax", "[training]\nsteps = = 3\n", ["syntax.toml:2:"])
    ok &= refused(train, out, "unknown_override", "", ["--training.stepz: unknown key",
                                                       "training.steps"],
                  ["--training.stepz", "3"])
    ok &= refused(train, out, "keep_one", "[checkpoint]\nenable = true\nkeep_latest_k = 1\n",
                  ["--keep-latest (checkpoint.keep_latest_k) 1", "at least 2"])
    ok &= refused(train, out, "layer_ac", "[activation_checkpoint]\nmode = \"selective\"\n",
                  ["activation_checkpoint.selective_ac_option", "\"2\""])
    ok &= refused(train, out, "reduce_dtype", "[training]\nmixed_precision_reduce = \"bfloat16\"\n",
                  ["training.mixed_precision_reduce", "float32"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
