#!/usr/bin/env bash
# The GPU paths on a machine with ONE CUDA GPU and a PyTorch of its own, but no build tools
# for dtensor (docs/testing.md, "On a GPU"). Two halves:
#   scripts/gpu-one.sh pack BUILD_DIR TARBALL   here: the library, the world1 test programs,
#        the training example of a -Dcuda=enabled build against that machine's LibTorch
#        version (-Dlibtorch=<its wheel's torch/>), stripped, into one tarball
#   scripts/gpu-one.sh run TARBALL [PROGRAMS...]  there: unpacks at the build's own path
#        (the programs' RUNPATHs and compiled-in paths name it), runs each world1 program on
#        one rank (NCCL, a cuda mesh: dtensor::testing::device_type()), then the Llama 3
#        recipe on the GPU; one line per program, the logs of failures, exit status 1 if any
#        failed.
# Environment (run): GPU_ONE_TORCH, the site-packages that hold torch and nvidia/ (default:
# python3's); GPU_ONE_TIMEOUT_S per program (default 120); GPU_ONE_JOBS programs at a time;
# GPU_ONE_TORCHRUN (default: beside python3); GPU_ONE_LOGS, a .tgz to write every log into.
set -uo pipefail

pack() {
  local build=$1 tarball=$2
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  local stage
  stage=$(mktemp -d)
  local abs
  abs=$(cd "$build" && pwd)
  mkdir -p "$stage/$abs"
  (cd "$abs" && cp -a --parents lib/libdtensor.so* test/test_* test/attention_meta_shapes.json \
    examples/train "$stage/$abs/") || exit 1
  # The system libraries dtensor links that a machine with only PyTorch lacks (fmt,
  # xxHash, SentencePiece), beside libdtensor: run puts that directory on the search path.
  for l in libfmt.so.9 libxxhash.so.0 libsentencepiece.so.0 libsentencepiece_train.so.0; do
    cp -L "$(ldconfig -p | awk -v l="$l" '$1 == l { print $NF; exit }')" "$stage/$abs/lib/" || exit 1
  done
  rm -rf "$stage/$abs/test/"*.p "$stage/$abs/lib/"*.p
  find "$stage" -type f \( -name 'test_*' -o -name 'train' -o -name 'libdtensor.so*' \) \
    -exec strip --strip-debug {} +
  tar -C "$stage" -cJf "$tarball" . && rm -rf "$stage"
  echo "packed $(du -h "$tarball" | cut -f1) from $abs (source $root)"
}

run() {
  local tarball=$1
  shift
  tar -C / -xJf "$tarball" || exit 1
  local build
  build=$(dirname "$(tar -tJf "$tarball" | grep -m1 '/lib/libdtensor.so' | sed 's|^\./|/|')")
  build=${build%/lib}
  local site=${GPU_ONE_TORCH:-$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')}
  local libs=$build/lib:$site/torch/lib
  for d in "$site"/nvidia/*/lib; do
    libs=$libs:$d
  done
  export LD_LIBRARY_PATH=$libs:${LD_LIBRARY_PATH:-}
  export OMP_NUM_THREADS=1 TORCH_CPP_LOG_LEVEL=ERROR
  local torchrun
  torchrun=${GPU_ONE_TORCHRUN:-$(dirname "$(command -v python3)")/torchrun}
  local timeout=${GPU_ONE_TIMEOUT_S:-120}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
  local programs=("$@")
  if ((${#programs[@]} == 0)); then
    mapfile -t programs < <(cd "$build/test" && ls test_* | sort)
  fi
  local failed=0 log
  log=$(mktemp -d)
  # Several programs at a time (GPU_ONE_JOBS, default 4): each is one process with its own
  # communicator on the one GPU.
  for p in "${programs[@]}"; do
    while (($(jobs -rp | wc -l) >= ${GPU_ONE_JOBS:-4})); do
      wait -n
    done
    (
      start=$SECONDS
      timeout "$timeout" "$torchrun" --standalone --nproc-per-node 1 --no-python \
        "$build/test/$p" >"$log/$p" 2>&1
      echo "$? $((SECONDS - start))" >"$log/$p.rc"
    ) &
  done
  wait
  for p in "${programs[@]}"; do
    local rc secs
    read -r rc secs <"$log/$p.rc"
    printf '%-32s rc %3d %4d s  %s\n' "$p" "$rc" "$secs" \
      "$(grep -E '^(test cases|All tests passed)' "$log/$p" | tail -1)"
    if ((rc != 0)); then
      failed=1
      grep -v '^\s*$' "$log/$p" | tail -n 40 | sed "s|^|  $p: |"
    fi
  done
  # The recipe on the GPU (one rank: mesh 1x1x1, bf16, full AC), a model larger than the
  # CPU demo's; the trainer prints tokens/s and the peak memory. GPU_ONE_TRAIN=0 skips it.
  if [[ ${GPU_ONE_TRAIN:-1} == 0 ]]; then
    return $failed
  fi
  local start=$SECONDS
  timeout "$timeout" "$torchrun" --standalone --nproc-per-node 1 --no-python \
    "$build/examples/train" --mesh 1x1x1 --steps 60 --log-every 10 --dim 1024 --layers 8 \
    --heads 16 --kv-heads 8 --seq 64 --batch 32 --metrics "$log/metrics.jsonl" \
    >"$log/train" 2>&1
  local rc=$?
  echo "train (llama 1x1x1, cuda)        rc $rc $((SECONDS - start)) s"
  tail -n 25 "$log/train"
  ((rc == 0)) || failed=1
  if [[ -n ${GPU_ONE_LOGS:-} ]]; then
    tar -C "$log" -czf "$GPU_ONE_LOGS" .
  fi
  return $failed
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 pack BUILD_DIR TARBALL | run TARBALL [PROGRAMS...]" >&2; exit 2 ;;
esac
