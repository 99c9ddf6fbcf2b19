#!/usr/bin/env bash
# The main job: set up (idempotent), build, and train the Llama 3 recipe (examples/train,
# models/llama3.h) on NPROC CPU ranks (default 8, as a 2x2x2 (dp_replicate, dp_shard, tp)
# mesh) on the fortune cookies of Debian's `fortunes` package (15,000 short documents, every
# 20th held out for the validation loss), then draw its training and validation loss. Extra
# arguments go to the trainer (--steps, --mesh, --pp, --cp, --model deepseek-v3 --ep 4,
# --config FILE, --data FILES, ...; train --help lists them; DEMO_DATA=builtin: the built-in
# paragraph). Output goes to train-out/ (metrics.jsonl, loss.png, TensorBoard's event files
# in tb/, the flight records in comm_traces/ if a collective fails).
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
data=()
if [[ ${DEMO_DATA:-fortunes} != builtin ]]; then
  fortunes=/usr/share/games/fortunes
  files=$(find "$fortunes" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort | paste -sd,)
  [[ -n $files ]] || { echo "demo: no fortune files in $fortunes (scripts/setup.sh installs them)" >&2; exit 1; }
  data=(--data "$files" --vocab 1024 --seq 64 --dim 128 --layers 4 --heads 8 --kv-heads 4
        --steps 300 --val-every 50 --log-every 25)
fi
torchrun --standalone --nproc-per-node "${NPROC:-8}" --no-python "$root/build/examples/train" \
  "${data[@]}" --metrics "$out/metrics.jsonl" --tensorboard "$out/tb" \
  --flight-recorder "$out/comm_traces" "$@"
if [[ -s $out/metrics.jsonl ]]; then
  "$venv/bin/python" "$root/scripts/plot_metrics.py" "$out/metrics.jsonl" "$out/loss.png"
fi
echo "TensorBoard: $venv/bin/tensorboard --logdir $out/tb (then open http://localhost:6006)"
