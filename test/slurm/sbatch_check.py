#!/usr/bin/env python3
"""scripts/slurm/train.sbatch on a 2-node x 2-task job played on this machine (meson test
slurm_sbatch): sbatch_check.py ROOT PROBE [TRAIN]

Stand-ins for srun and scontrol (test/slurm/bin, first on PATH) start the 4 tasks here with the
variables SLURM gives them; the ranks rendezvous over Gloo. Checks:
- the script: MASTER_ADDR is the job's first host (from `scontrol show hostnames`), MASTER_PORT
  the job's own, and every rank (PROBE, test/slurm/launch_probe.cpp) sees RANK, WORLD_SIZE,
  LOCAL_RANK, LOCAL_WORLD_SIZE as SLURM's PROCID, NTASKS, LOCALID, NTASKS_PER_NODE, joins the
  world (an all-reduce sums to 4), and gets the script's arguments;
- the library alone: PROBE under srun without the script resolves the same world from SLURM's
  own variables (lib/mesh/launch_env.h);
- refusals: a job without --ntasks-per-node, a missing program;
- with TRAIN: the script's default program (build/examples/train under the submit directory)
  trains 2 steps.
No launch warning on stderr anywhere (no CUDA device here).
"""
import os
import random
import socket
import subprocess
import sys
import tempfile

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
NODELIST = "127.0.0.[1-2]"  # what scontrol expands: 127.0.0.1 (the first host), 127.0.0.2
LAUNCH_WARNING = "init_process_group (rank"  # lib/mesh/launch_env.cpp's warning


def port_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def job_id_with_free_port():
    """A job id whose port (train.sbatch: 20000 + id % 20000) is free now."""
    for _ in range(100):
        port = random.randrange(20000, 40000)
        if port_free(port):
            return 100000 + port - 20000, port
    sys.exit("no free port in 20000-39999")


def batch_env(root, tmp, job_id):
    """The environment of a batch script of the job (before srun), without any launcher's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TORCHELASTIC_", "ROLE_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                         "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=os.path.join(root, "test", "slurm", "bin") + os.pathsep + env["PATH"],
               FAKE_SLURM_LOG=os.path.join(tmp, "slurm.log"), OMP_NUM_THREADS="1",
               SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME="dtensor-train",
               SLURM_JOB_NODELIST=NODELIST, SLURM_NODELIST=NODELIST,
               SLURM_JOB_NUM_NODES=str(NODES), SLURM_NNODES=str(NODES),
               SLURM_NTASKS=str(WORLD), SLURM_NPROCS=str(WORLD),
               SLURM_NTASKS_PER_NODE=str(PER_NODE), SLURM_TASKS_PER_NODE=f"{PER_NODE}(x{NODES})",
               SLURM_SUBMIT_DIR=tmp, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    return env


def run(cmd, env, cwd):
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
    print(f"$ {' '.join(cmd)}  (exit {p.returncode})\n{p.stdout}{p.stderr}", flush=True)
    return p


def probe_lines(stdout):
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("probe "):
            row = dict(kv.split("=", 1) for kv in line.split()[1:])
            rows[int(row["rank"])] = row
    return rows


def expect_probes(p, sources, master, args, failures, what):
    rows = probe_lines(p.stdout)
    if p.returncode != 0 or sorted(rows) != list(range(WORLD)):
        failures.append(f"{what}: exit {p.returncode}, ranks that printed: {sorted(rows)}")
        return
    for r, row in rows.items():
        want = dict(rank=str(r), world=str(WORLD), local_rank=str(r % PER_NODE),
                    local_world=str(PER_NODE), backend="gloo", device="0", sum=str(WORLD),
                    sources=sources, master=master, args=args)
        if row != want:
            failures.append(f"{what}: rank {r} saw {row}, expected {want}")
    if LAUNCH_WARNING in p.stderr:
        failures.append(f"{what}: a launch warning on stderr")


def main():
    root, probe, *train = map(os.path.abspath, sys.argv[1:])  # meson's are relative to build/
    script = os.path.join(root, "scripts", "slurm", "train.sbatch")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        job_id, port = job_id_with_free_port()
        env = batch_env(root, tmp, job_id)

        # The script, with the probe as its program and two arguments.
        p = run(["bash", script, "--steps", "1"], dict(env, DTENSOR_TRAIN=probe), tmp)
        expect_probes(p, "RANK,WORLD_SIZE,LOCAL_RANK,LOCAL_WORLD_SIZE", f"127.0.0.1:{port}",
                      "--steps,1", failures, "train.sbatch")
        log = open(env["FAKE_SLURM_LOG"]).read() if os.path.exists(env["FAKE_SLURM_LOG"]) else ""
        if (f"scontrol show hostnames {NODELIST}" not in log
                or "srun --kill-on-bad-exit=1" not in log):
            failures.append(f"train.sbatch: scontrol/srun not called as expected: {log!r}")
        if f"{WORLD} ranks, {PER_NODE} per node, rendezvous at 127.0.0.1:{port}" not in p.stdout:
            failures.append("train.sbatch: no header line naming the ranks and the rendezvous")

        # The library alone: srun starts the probe, no mapping; MASTER_* exported by hand.
        _, port2 = job_id_with_free_port()
        p = run(["srun", probe], dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port2)), tmp)
        expect_probes(p, "SLURM_PROCID,SLURM_STEP_NUM_TASKS,SLURM_LOCALID,"
                      "SLURM_STEP_TASKS_PER_NODE", f"127.0.0.1:{port2}", "", failures,
                      "srun without the script")

        # Refusals, before any task starts.
        no_per_node = {k: v for k, v in env.items() if k != "SLURM_NTASKS_PER_NODE"}
        p = run(["bash", script], dict(no_per_node, DTENSOR_TRAIN=probe), tmp)
        if p.returncode == 0 or "--ntasks-per-node" not in p.stderr or "probe " in p.stdout:
            failures.append("train.sbatch without SLURM_NTASKS_PER_NODE was not refused by name")
        p = run(["bash", script], env, tmp)  # no build/ under the submit directory
        if p.returncode == 0 or "no program at" not in p.stderr:
            failures.append("train.sbatch without a program was not refused by name")

        # The default program: the trainer, 2 steps of the built-in recipe.
        if train:
            os.makedirs(os.path.join(tmp, "build", "examples"))
            os.symlink(train[0], os.path.join(tmp, "build", "examples", "train"))
            metrics = os.path.join(tmp, "metrics.jsonl")
            p = run(["bash", script, "--steps", "2", "--log-every", "1", "--metrics", metrics],
                    env, tmp)
            steps = open(metrics).read().count('"step"') if os.path.exists(metrics) else 0
            if p.returncode != 0 or steps != 2 or LAUNCH_WARNING in p.stderr:
                failures.append(f"train.sbatch with the trainer: exit {p.returncode}, "
                                f"{steps} steps in {metrics}")
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
