#!/usr/bin/env bash
# The main job: set up (idempotent), build, and train the Llama 3 recipe (examples/train,
# models/llama3.h) on NPROC CPU ranks (default 8, as a 2x2x2 (dp_replicate, dp_shard, tp)
# mesh), then draw its loss curve. Extra arguments go to the trainer (--steps, --mesh, --dim,
# --export-hf DIR, ...; train --help lists them). Output goes to train-out/ (metrics.jsonl, loss.png).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# The main job needs the default LibTorch only; the second one (2.9.1, a 3.9 GB wheel) comes
# with scripts/test.sh.
DTENSOR_SKIP_OLD_TORCH=1 "$root/scripts/setup.sh"
configure "$root/build" -Dcuda=disabled >/dev/null
ninja -C "$root/build" examples/train >/dev/null
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-WARNING}
# torchrun imports torch, which warns that NumPy is missing (dtensor never needs it).
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}
out=${DEMO_OUT:-$PWD/train-out}
mkdir -p "$out"
torchrun --standalone --nproc-per-node "${NPROC:-8}" --no-python "$root/build/examples/train" \
  --metrics "$out/metrics.jsonl" "$@"
if [[ -s $out/metrics.jsonl ]]; then
  "$venv/bin/python" "$root/scripts/plot_metrics.py" "$out/metrics.jsonl" "$out/loss.png"
fi
