#!/usr/bin/env python3
"""What the main job shows a training team: TensorBoard's event files, read by TensorBoard's
own reader, and profiler traces (meson test observability_recipe).

usage: observability_recipe.py TORCHRUN TRAIN FORTUNES OUT_DIR
Two 2-rank runs of examples/train on Debian's fortunes (validation every 3 steps, an MFU
peak given):
  flags:    --tensorboard DIR: rank 0's events in DIR/<date-time>; --profile: steps 3 and 6
            traced on each rank;
  job file: [metrics] enable_tensorboard, save_tb_folder, save_for_all_ranks and
            [job] dump_folder: every rank's events in dump_folder/save_tb_folder/<date-time>/rank_R.
Each event file is read with tensorboard's EventAccumulator (which checks every record's
CRC-32C); every scalar of every step must equal the metrics file's value (as float32, the
width TensorBoard stores), the tags must be exactly those the metrics line has, and every
rank's loss, gradient norm and learning rate must be the same. Each trace must parse as
Chrome trace JSON and name LibTorch's operators, the modules (by path) and a dtensor
collective of every kind the metrics file counts for that step.
"""
import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipe_runs import fortune_files, launch

STEPS = 6
FLAGS = ["--vocab", "256", "--precision", "fp32", "--seq", "32", "--batch", "8",
         "--steps", str(STEPS), "--log-every", "1", "--val-every", "3", "--val-steps", "1",
         "--mesh", "1x1x2", "--peak-tflops", "0.001"]

# The metrics line's keys and their TensorBoard tags (docs/observability.md).
TAGS = {"loss": "loss_metrics/global_avg_loss", "grad_norm": "grad_norm",
        "tokens_per_s_per_device": "throughput(tps)", "tokens_per_s": "throughput_job(tps)",
        "tflops_per_device": "tflops", "mfu_pct": "mfu(%)", "step_s": "time_metrics/end_to_end(s)",
        "tokens_seen": "n_tokens_seen", "peak_resident_mib": "memory/peak_resident(MiB)",
        "max_live_tensor_mib": "memory/max_live_tensors(MiB)",
        "val_loss": "validation_metrics/loss", "lr": "lr/AdamW"}


def expected(rows):
    """{tag: {step: value}} from the metrics file's rows."""
    want = {}
    for row in rows:
        for key, tag in TAGS.items():
            if key in row:
                want.setdefault(tag, {})[row["step"]] = row[key]
        for group in ("collectives", "collective_bytes"):
            for kind, n in row[group].items():
                want.setdefault(f"{group}/{kind}", {})[row["step"]] = n
    return want


def judge(label, folder, want):
    """Reads `folder`'s events with TensorBoard's reader; True when they equal `want`."""
    files = glob.glob(os.path.join(folder, "events.out.tfevents.*"))
    if len(files) != 1:
        print(f"FAIL {label}: {len(files)} event files in {folder}")
        return False
    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    ok = tags == set(want)
    if not ok:
        print(f"FAIL {label}: tags {sorted(tags ^ set(want))} in one only")
    for tag in sorted(tags & set(want)):
        got = {e.step: e.value for e in acc.Scalars(tag)}
        exp = {s: float(np.float32(v)) for s, v in want[tag].items()}
        if got != exp:
            print(f"FAIL {label}: {tag}: TensorBoard {got} against the metrics file {exp}")
            ok = False
    print(f"{label}: {len(tags)} tags over steps {sorted(want['grad_norm'])} "
          f"{'equal' if ok else 'DIFFER from'} the metrics file")
    return ok


def judge_traces(folder, rows):
    """The Chrome traces of steps 3 and 6 (counted from 1) of both ranks."""
    ok = True
    for step in (3, 6):
        for rank in (0, 1):
            path = os.path.join(folder, f"iteration_{step}", f"rank{rank}_trace.json")
            try:
                events = json.load(open(path))["traceEvents"]
            except (OSError, ValueError, KeyError) as e:
                print(f"FAIL trace {path}: {e}")
                ok = False
                continue
            names = {e.get("name", "") for e in events}
            kinds = rows[step - 1]["collectives"]  # the step's collectives, by kind
            missing = [k for k in kinds if not any(n.startswith("dtensor::" + k) for n in names)]
            modules = sorted(n for n in names if n.startswith("module: "))
            good = (not missing and "aten::mm" in names and "module: layers.0" in names
                    and "module: output" in names)
            named = sorted(n for n in names if any(n.startswith("dtensor::" + k) for k in kinds))
            print(f"trace step {step} rank {rank}: {len(events)} events; collectives {named}; "
                  f"{len(modules)} modules{'' if good else f'; FAIL: kinds {missing} missing or no aten::mm / modules {modules[:8]}'}")
            ok = ok and good
    return ok


def train(torchrun, train_bin, args, metrics):
    if os.path.exists(metrics):
        os.remove(metrics)
    p = launch(torchrun, train_bin, 2, [*args, "--metrics", metrics])
    print(p.stdout[-1500:])
    if p.returncode != 0:
        print(p.stderr[-3000:])
        sys.exit(f"FAIL: exit {p.returncode}")
    return [json.loads(line) for line in open(metrics)]


def main():
    torchrun, train_bin, fortunes, out = sys.argv[1:]
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    data = ["--data", ",".join(fortune_files(fortunes))]

    tb = os.path.join(out, "tb")
    traces = os.path.join(out, "traces")
    rows = train(torchrun, train_bin, FLAGS + data + ["--tensorboard", tb, "--profile", traces,
                                                      "--profile-freq", "3"],
                 os.path.join(out, "flags.jsonl"))
    runs = glob.glob(os.path.join(tb, "*"))
    ok = len(runs) == 1 and judge("--tensorboard (rank 0)", runs[0], expected(rows))
    ok = judge_traces(traces, rows) and ok
    want = expected(rows)
    ok = ok and sorted(want["validation_metrics/loss"]) == [2, 5] and len(want["mfu(%)"]) == STEPS

    dump = os.path.join(out, "dump")
    config = os.path.join(out, "job.toml")
    with open(config, "w") as f:
        f.write(f'[job]\ndump_folder = "{dump}"\n\n[metrics]\nenable_tensorboard = true\n'
                'save_tb_folder = "board"\nsave_for_all_ranks = true\n')
    rows = train(torchrun, train_bin, ["--config", config] + FLAGS + data,
                 os.path.join(out, "file.jsonl"))
    ranks = sorted(glob.glob(os.path.join(dump, "board", "*", "rank_*")))
    if [os.path.basename(r) for r in ranks] != ["rank_0", "rank_1"]:
        print(f"FAIL job file: event folders {ranks}")
        ok = False
    if ranks:
        ok = judge("job file (rank_0)", ranks[0], expected(rows)) and ok
    # The other rank: the same tags; the job's figures (loss, norm, learning rate, validation
    # loss, tokens seen, the largest rank's peak memory) equal; its own times and collectives.
    shared = {"loss_metrics/global_avg_loss", "grad_norm", "lr/AdamW", "validation_metrics/loss",
              "n_tokens_seen", "memory/peak_resident(MiB)", "memory/max_live_tensors(MiB)"}
    for folder in ranks[1:]:
        want = expected(rows)
        acc = EventAccumulator(folder, size_guidance={"scalars": 0})
        acc.Reload()
        got = set(acc.Tags()["scalars"])
        same = got == set(want) and all(
            {e.step: e.value for e in acc.Scalars(t)} ==
            {k: float(np.float32(v)) for k, v in want[t].items()} for t in shared)
        print(f"job file ({os.path.basename(folder)}): {len(got)} tags; the job's figures "
              f"{'equal' if same else 'DIFFER from'} the metrics file")
        ok = same and ok
    print("observability_recipe:", "ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
