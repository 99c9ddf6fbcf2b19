#!/usr/bin/env python3
"""The recipe's TOML job files (meson test config_recipe).

usage: config_recipe.py TORCHRUN TRAIN CONFIGS FORTUNES_DIR OUTDIR
- configs/debug_model.toml with --steps 3 --tp 2 --dp-replicate 1 on 2 ranks, and the same run
  spelled as flags only (--mesh 1x1x2 and every key's flag): every step's loss and gradient
  norm equal, bit for bit, and the same collectives (the file and the flags are one run).
- torchtitan's overrides: `--training.steps=3 --parallelism.tensor_parallel_degree 2 ...`
  give the same run as the flags, bit for bit.
- A job file written for torchtitan (sections and keys this recipe does not implement) loads
  with one warning naming those keys, and trains; with checkpoint.enable false its
  [checkpoint] keys take no effect (nothing written), with true the checkpoint lands in
  job.dump_folder / checkpoint.folder.
- torchtitan's own debug_model.toml, as its last TOML release published it (below, verbatim),
  run as torchtitan runs it (from a folder holding tests/assets/tokenizer/tokenizer.json and
  tests/assets/c4_test/data.json, here a BPE that the `tokenizers` package trained and fortunes
  as C4's JSON lines), with --training.steps 3 --training.seq_len 128 (a short run): one
  warning naming its keys this recipe does not implement; the model is torchtitan's
  debugmodel flavor (vocab 2048, dim 256, 6 layers, 16 heads), trained as the file says (FSDP
  over both ranks, local batch 8, AdamW lr 8e-4 after 2 warmup steps: 4e-4 then 8e-4, AC on
  every 2nd block); the documents and their tokens are those `tokenizers` counts; the loss falls.
- A job file's omitted keys take torchtitan's defaults (lr 8e-4, warmup 200, no decay ratio,
  seq_len 2048, local batch 8, FSDP over the ranks left, head-tail cp balancing, every 2nd
  block checkpointed), shown by the job's start-up line.
- FLOPs per token in the metrics equal torchtitan's own formula
  (torchtitan.models.utils.get_dense_model_nparams_and_flops, the venv's torchtitan) on
  PyTorch's Llama 3 of tools/torch_llama3.py with the same shape, for the small default model
  and for debugmodel; TFLOPs per device and MFU (`--peak-tflops`) follow from them.
- A one-step job (`--training.steps 1`, a smoke run) exits 0: one step has no loss to
  compare with.
- Determinism: debug.deterministic with the same debug.seed twice gives bit-equal losses;
  another seed other ones.
- Refusals, each naming the file and the key, before anything runs (exit 2): an unknown key
  (with the section's known keys), a value of the wrong type, a value outside the flag's
  choices (torchtitan's where its key has its own: context_parallel_load_balancer), a TOML
  syntax error (with its line), an unknown `--section.key`, keep_latest_k 1, a
  selective_ac_option that is neither "op" nor a number, a reduction dtype other than
  float32, a dataset torchtitan does not name (and c4 without its path), a model.name
  this recipe lacks, a capacity factor of 0 for expert parallelism's capacity dispatch,
  overlapped chunks without capacity dispatch.
- Capacity dispatch with buffers too small (--ep-capacity-factor 0.1, 2 ranks, ep 2): the
  first step stops at the end of its backward, naming the rows over the capacity.
"""
import json
import os
import shutil
import subprocess
import sys

from recipe_runs import fortune_files, launch, run as run_recipe

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
IGNORED = ["job.description", "job.print_config", "parallelism.fsdp_reshard_after_forward",
           "compile.enable", "compile.components"]


# torchtitan's torchtitan/models/llama3/train_configs/debug_model.toml as published before its
# job files moved to Python (pytorch/torchtitan, the parent of 9810191bb, 2026-02-23), verbatim.
DEBUG_MODEL_TOML = """[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
# test folder with tokenizer.json, for debug purpose only
hf_assets_path = "./tests/assets/tokenizer"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2  # lr scheduler warm up, normally 20% of the train steps
decay_ratio = 0.8  # lr scheduler decay ratio, 80% of the train steps
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0  # grad norm clipping
steps = 10
dataset = "c4_test"  # supported datasets: c4_test (2K), c4 (177M)

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default" # default / never / always
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "Interleaved1F1B"
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"  # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = '2'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 5
steps = 10
"""
DEBUG_MODEL_IGNORED = [
    "compile.components", "compile.enable", "job.description", "job.print_config",
    "metrics.disable_color_printing", "metrics.enable_wandb",
    "parallelism.enable_async_tensor_parallel",
    "parallelism.fsdp_reshard_after_forward", "quantize.linear.float8.filter_fqns",
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "validation.dataset"]


def torchtitan_flops(dim, layers, heads, kv_heads, vocab, multiple_of, seq):
    """torchtitan's FLOPs per token for PyTorch's Llama 3 of this shape (the judge)."""
    import torch
    from torchtitan.models.utils import get_dense_model_nparams_and_flops
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "tools"))
    import torch_llama3
    with torch.device("meta"):
        model = torch_llama3.Llama(dim, layers, heads, kv_heads, vocab,
                                   torch_llama3.hidden_dim(dim, multiple_of))
    return get_dense_model_nparams_and_flops(model, layers, heads, 2 * (dim // heads), seq)[1]


def same_flops(label, rows, want):
    got = {r["flops_per_token"] for r in rows}
    ok = got == {want}
    print(f"{'ok' if ok else 'FAIL'} {label}: FLOPs per token {got} against torchtitan's {want}")
    return ok


def torchtitan_assets(folder, fortunes):
    """torchtitan's test assets as its debug job reads them: a byte-level BPE of 1000 ids
    trained by `tokenizers` (vocab within debugmodel's 2048) and 600 fortunes as C4's JSON
    lines. The documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    docs = []
    for path in fortune_files(fortunes):
        with open(path, encoding="utf-8", errors="replace") as f:
            docs += [d.strip() for d in f.read().split("\n%\n") if d.strip()]
    docs = docs[:600]
    for sub in ("tokenizer", "c4_test"):
        os.makedirs(os.path.join(folder, "tests", "assets", sub), exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(folder, "tests", "assets", "tokenizer", "tokenizer.json"))
    with open(os.path.join(folder, "tests", "assets", "c4_test", "data.json"), "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z",
                                "url": f"https://example.org/{i}"}) + "\n")
    return docs, tok


def torchtitan_debug_model(torchrun, train, out, fortunes):
    folder = os.path.join(out, "tt-debug-model")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    docs, tok = torchtitan_assets(folder, fortunes)
    with open(os.path.join(folder, "debug_model.toml"), "w") as f:
        f.write(DEBUG_MODEL_TOML)
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", "--no-python",
                        os.path.abspath(train), "--job.config_file", "debug_model.toml",
                        "--training.steps", "3", "--training.seq_len", "128"],
                       capture_output=True, text=True,
                       errors="replace", timeout=280, cwd=folder,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    ok = p.returncode == 0
    if not ok:
        print(p.stdout[-2000:], p.stderr[-3000:])
    warnings = [line for line in p.stderr.splitlines() if "warning:" in line]
    named = len(warnings) == 1 and all(k in warnings[0] for k in DEBUG_MODEL_IGNORED)
    print(f"{'ok' if named else 'FAIL'} debug_model.toml: one warning naming its "
          f"{len(DEBUG_MODEL_IGNORED)} keys not implemented: {warnings}")
    head = next((line for line in p.stdout.splitlines() if line.startswith("dtensor train")), "")
    wants = ["(dp_replicate=1, dp_shard=2, tp=1)", "vocab 2048, dim 256, 6 layers, 16/16 heads",
             "batch 16 x 128", "AC full on 1 block in 2", "lr 0.0008", "warmup 2"]
    shaped = all(w in head for w in wants)
    print(f"{'ok' if shaped else 'FAIL'} debugmodel as the file says: {head}")
    # Every 20th document held out; each trained one is bos, its tokens, eos.
    train_docs = [d for i, d in enumerate(docs) if i % 20 != 19]
    tokens = sum(len(tok.encode(d, add_special_tokens=False).ids) + 2 for d in train_docs)
    want = f"{len(train_docs)} documents, {tokens} tokens"
    data_line = next((line for line in p.stdout.splitlines() if line.startswith("data:")), "")
    read = want in data_line and "tests/assets/tokenizer/tokenizer.json" in data_line
    print(f"{'ok' if read else 'FAIL'} c4_test and hf_assets_path: want {want!r}: {data_line}")
    rows = [json.loads(line) for line in open(os.path.join(folder, "train-out", "metrics.jsonl"))] \
        if ok else []
    lrs = [r["lr"] for r in rows]
    losses = [r["loss"] for r in rows]
    trained = (len(rows) == 3 and abs(lrs[0] - 4e-4) < 1e-12 and abs(lrs[1] - 8e-4) < 1e-12
               and losses[-1] < losses[0])
    print(f"{'ok' if trained else 'FAIL'} trains: lr {lrs}, losses {losses}")
    flops = same_flops("debugmodel, seq 128", rows, torchtitan_flops(256, 6, 16, 16, 2048, 256, 128))
    return ok and named and shaped and read and trained and flops


def file_defaults(torchrun, train, out):
    """A job file that gives the steps, the sequence, the local batch and cp 2 only (kept
    small): the rest is torchtitan's (FSDP over the ranks left, head-tail cp balancing), read off the job's start-up line and its learning rates (lr 8e-4
    with a warmup of 200 steps, clamped to the run's 3 steps, and no decay: 8e-4 x 1/3, 2/3, 1;
    the flags' defaults would give 3e-3 x 1/2, then 1, then decay)."""
    path = os.path.join(out, "defaults.toml")
    with open(path, "w") as f:
        f.write("[training]\nsteps = 3\nseq_len = 32\nlocal_batch_size = 2\n"
                "[parallelism]\ncontext_parallel_degree = 2\n")
    metrics = os.path.join(out, "defaults.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    p = launch(torchrun, train, 2, ["--config", path, "--metrics", metrics,
                                    "--peak-tflops", "0.05"])
    head = next((line for line in p.stdout.splitlines() if line.startswith("dtensor train")), "")
    wants = ["(dp_replicate=1, dp_shard=1, cp=2 allgather (head-tail), tp=1)",
             "dim 256, 6 layers, 16/16 heads", "batch 2 x 32", "AC full on 1 block in 2",
             "lr 0.0008"]
    rows = [json.loads(line) for line in open(metrics)] if p.returncode == 0 else []
    lrs = [r["lr"] for r in rows]
    want = [8e-4 / 3, 16e-4 / 3, 8e-4]
    # TFLOPs per device: FLOPs per token x the job's tokens/s over its 2 ranks; MFU against
    # the --peak-tflops given, in percent.
    rates = all(abs(r["tflops_per_device"] - r["flops_per_token"] * r["tokens_per_s"] / 2e12)
                <= 1e-9 * r["tflops_per_device"] and
                abs(r["mfu_pct"] - 100 * r["tflops_per_device"] / 0.05) <= 1e-9 * r["mfu_pct"]
                for r in rows)
    ok = (p.returncode == 0 and all(w in head for w in wants) and len(lrs) == 3
          and all(abs(a - b) < 1e-12 for a, b in zip(lrs, want)) and rates)
    print(f"{'ok' if ok else 'FAIL'} a job file's defaults are torchtitan's: exit {p.returncode}: "
          f"lr {lrs}: {head}")
    if p.returncode != 0:
        print(p.stderr[-2000:])
    return ok


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


def overflow_refused(torchrun, train, out):
    """Capacity dispatch with buffers too small: the first step stops after its backward, before
    any optimizer step, naming the rows over the capacity (the same text on every rank:
    test_moe_capacity)."""
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", "--no-python", train,
                        "--model", "deepseek-v3", "--ep", "2", "--ep-dispatch", "capacity",
                        "--ep-capacity-factor", "0.1", "--steps", "2", "--metrics",
                        os.path.join(out, "overflow.jsonl")],
                       capture_output=True, text=True, errors="replace", timeout=120)
    text = p.stdout + p.stderr
    named = [line for line in text.splitlines() if "over the capacity of" in line]
    ok = p.returncode != 0 and bool(named) and "refused at the end of the backward" in named[0]
    print(f"{'ok' if ok else 'FAIL'} capacity overflow refused: exit {p.returncode}: "
          f"{named[:1] or text.splitlines()[-3:]}")
    return ok


def main():
    torchrun, train, configs, fortunes, out = sys.argv[1:6]
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
    ok &= same_flops("the small model, seq 32", a, torchtitan_flops(64, 2, 4, 2, 128, 32, 32))
    c = run_recipe(torchrun, train, 2, out, ["--config", debug, "--parallelism.tensor_parallel_degree",
                                             "2", "--parallelism.data_parallel_replicate_degree=1",
                                             "--metrics.log_freq", "1"], ["--training.steps=3"])[0]
    same = len(c) == 3 and all(x[k] == y[k] for x, y in zip(a, c)
                               for k in ("loss", "grad_norm", "collectives"))
    print(f"{'ok' if same else 'FAIL'} torchtitan's overrides: losses {[r['loss'] for r in c]}")
    ok &= same
    ok &= torchtitan_job(torchrun, train, out, "false")
    ok &= torchtitan_job(torchrun, train, out, "true")
    ok &= torchtitan_debug_model(torchrun, train, out, fortunes)
    ok &= file_defaults(torchrun, train, out)
    p = subprocess.run([train, "--training.steps", "1", "--metrics",
                        os.path.join(out, "one-step.jsonl")], capture_output=True, text=True,
                       errors="replace", timeout=120)
    one = p.returncode == 0 and "(one step: nothing to compare)" in p.stdout
    print(f"{'ok' if one else 'FAIL'} one step: exit {p.returncode}: {p.stdout.splitlines()[-1:]}")
    ok &= one
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
    ok &= refused(train, out, "load_balancer",
                  "[parallelism]\ncontext_parallel_load_balancer = \"round\"\n",
                  ["parallelism.context_parallel_load_balancer: \"round\" is not one of "
                   "\"headtail\", \"ptrr\""])
    ok &= refused(train, out, "bad_precision", "[training]\nmixed_precision_param = \"fp8\"\n",
                  ["training.mixed_precision_param: \"fp8\" is not one of \"bfloat16\""])
    ok &= refused(train, out, "syntax", "[training]\nsteps = = 3\n", ["syntax.toml:2:"])
    ok &= refused(train, out, "unknown_override", "", ["--training.stepz: unknown key",
                                                       "training.steps"],
                  ["--training.stepz", "3"])
    ok &= refused(train, out, "keep_one", "[checkpoint]\nenable = true\nkeep_latest_k = 1\n",
                  ["--keep-latest (checkpoint.keep_latest_k) 1", "at least 2"])
    ok &= refused(train, out, "layer_ac", "[activation_checkpoint]\nmode = \"selective\"\n"
                  "selective_ac_option = \"two\"\n",
                  ["activation_checkpoint.selective_ac_option", "\"two\" is neither"])
    ok &= refused(train, out, "capacity_factor", "[parallelism]\nexpert_parallel_dispatch = "
                  "\"capacity\"\nexpert_parallel_capacity_factor = 0.0\n",
                  ["--ep-capacity-factor 0", "must be a positive number"])
    ok &= refused(train, out, "overlap", "[parallelism]\nexpert_parallel_overlap = true\n",
                  ["--ep-overlap splits capacity dispatch's buffers", "--ep-dispatch capacity"])
    ok &= overflow_refused(torchrun, train, out)
    ok &= refused(train, out, "dataset", "[training]\ndataset = \"openwebtext\"\n",
                  ["training.dataset", "\"openwebtext\" is not one of", "c4_test"])
    ok &= refused(train, out, "c4", "[training]\ndataset = \"c4\"\n",
                  ["training.dataset", "training.dataset_path"])
    ok &= refused(train, out, "model_name", "[model]\nname = \"llama4\"\nflavor = \"17bx16e\"\n",
                  ["model.name", "\"llama4\" is not one of llama3"])
    ok &= refused(train, out, "reduce_dtype", "[training]\nmixed_precision_reduce = \"bfloat16\"\n",
                  ["training.mixed_precision_reduce", "float32"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
