#!/usr/bin/env bash
# The main job: set up (idempotent), build, and run the demo on 4 CPU ranks as a 2x2 mesh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$root/scripts/setup.sh"
configure "$root/build" -Dcuda=disabled
ninja -C "$root/build" examples/demo
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-WARNING}
exec torchrun --standalone --nproc-per-node "${NPROC:-4}" --no-python "$root/build/examples/demo"
