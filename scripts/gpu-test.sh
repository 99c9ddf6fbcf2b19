#!/usr/bin/env bash
# The test suites on GPUs, for a machine with 2 or 4 CUDA GPUs (none here: CI only compiles
# and links the CUDA variant). Builds build-cuda with -Dcuda=enabled and the tests, then runs
# the world1, world2 and -- with 4 GPUs -- world4 suites. Each rank gets its own GPU
# (LOCAL_RANK) and the ranks talk over ProcessGroupNCCL: init_process_group picks NCCL when
# the build has it and a GPU is visible, so every test's mesh is a cuda mesh (a suite needs a
# GPU per rank: NCCL refuses two ranks on one device).
#   scripts/gpu-test.sh [extra meson test arguments]
# Environment: CUDA_VISIBLE_DEVICES to choose the GPUs; DTENSOR_GPU_SUITES to override the
# suites (e.g. "world2").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$root/scripts/setup.sh"

if ! ls "$venv"/lib/python3*/site-packages/torch/lib/libtorch_cuda.so >/dev/null 2>&1; then
  echo "gpu-test: this LibTorch has no libtorch_cuda (install a CUDA torch wheel in .venv)" >&2
  exit 2
fi
gpus=$("$venv/bin/python" -c 'import torch; print(torch.cuda.device_count())')
if ((gpus < 2)); then
  echo "gpu-test: needs at least 2 visible CUDA GPUs, found $gpus" >&2
  exit 2
fi
suites=${DTENSOR_GPU_SUITES:-"world1 world2"}
if [[ -z ${DTENSOR_GPU_SUITES:-} ]] && ((gpus >= 4)); then
  suites="world1 world2 world4"
fi
echo "[gpu-test] $gpus GPU(s); suites: $suites"

configure "$root/build-cuda" -Dcuda=enabled -Dtests=true -Dexamples=true -Dwerror=true
ninja -C "$root/build-cuda"
args=()
for s in $suites; do
  args+=(--suite "$s")
done
# The conformance suite compares with PyTorch on Gloo CPU ranks; it is left to scripts/test.sh.
exec meson test -C "$root/build-cuda" --print-errorlogs --no-suite conformance "${args[@]}" "$@"
