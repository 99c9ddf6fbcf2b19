#!/usr/bin/env bash
# The main job: set up (idempotent), build, and train a small Transformer on 4 CPU ranks as a
# (dp=2, tp=2) mesh (examples/train.cpp). Extra arguments go to the trainer (--steps, --dim, ...).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$root/scripts/setup.sh"
configure "$root/build" -Dcuda=disabled
ninja -C "$root/build" examples/train
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-WARNING}
# torchrun imports torch, which warns that NumPy is missing (dtensor never needs it).
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}
exec torchrun --standalone --nproc-per-node "${NPROC:-4}" --no-python "$root/build/examples/train" "$@"
