#!/usr/bin/env bash
# The whole test suite: set up (idempotent), build, run every suite (world1, world2, world4,
# world8, conformance) on the default LibTorch (2.15), then the AddressSanitizer +
# UndefinedBehaviorSanitizer subset (scripts/sanitize.sh), then the library and a smoke
# subset of the tests against the older LibTorch (2.9.1: scripts/old-torch-test.sh), then
# build the CUDA/NCCL variant of the library and the main job's program (compile and link
# only: no GPU is needed, nothing of it runs here).
# Extra arguments go to `meson test`.
#   scripts/test.sh --sanitize   only the sanitizer build, on the whole world1 + world2 suites
#   scripts/test.sh --quick      the inner loop: the default build and its world1 + world2
#                                suites only (no world4 / world8, sanitizers, 2.9.1, CUDA)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [[ ${1:-} == --sanitize ]]; then
  shift
  exec "$root/scripts/sanitize.sh" --all "$@"
fi
if [[ ${1:-} == --quick ]]; then
  shift
  export DTENSOR_SKIP_SANITIZE=1 DTENSOR_SKIP_OLD_TORCH=1 DTENSOR_SKIP_CUDA_BUILD=1 DTENSOR_QUICK=1
  set -- --suite world1 --suite world2 "$@"
fi
total_start=$SECONDS
# The main venv first; the second LibTorch (2.9.1, for its phase after the suites) downloads
# and installs beside the CPU build (scripts/setup.sh is idempotent: its second run only
# checks the main venv's stamp).
DTENSOR_SKIP_OLD_TORCH=1 "$root/scripts/setup.sh"
old_setup_pid=
old_setup_log=$(mktemp)
if [[ ${DTENSOR_SKIP_OLD_TORCH:-0} != 1 ]]; then
  "$root/scripts/setup.sh" >"$old_setup_log" 2>&1 &
  old_setup_pid=$!
fi
# A clean clone grows to about 15 GB (docs/build.md, "Disk"); a full disk fails a link.
free_disk() { df -h --output=avail "$root" | tail -1 | tr -d ' '; }
echo "[test] free disk: $(free_disk)"

start=$SECONDS
# Warnings are errors in the test command, not for users ([Note: warnings as errors] in
# meson.build).
configure "$root/build" -Dcuda=disabled -Dwerror=true
# PyTorch's side of the conformance tests whose records the oracle cache lacks, one torchrun
# per world size, beside the build ([Note: the oracle's batch] in test/conformance/prefill.py).
prefill_suites=()
[[ ${DTENSOR_QUICK:-0} == 1 ]] && prefill_suites=(--suite world1 --suite world2)
"$venv/bin/python" "$root/test/conformance/prefill.py" "$root/build" "${prefill_suites[@]}" \
  >"$root/build/oracle-prefill.log" 2>&1 &
prefill_pid=$!
# A failed build leaves no oracle or download running.
trap 'kill $prefill_pid $old_setup_pid 2>/dev/null || true; rm -f "$old_setup_log"' EXIT
ninja -C "$root/build"
echo "[test] CPU build: $((SECONDS - start)) s"
wait $prefill_pid || true
grep '^\[prefill\]' "$root/build/oracle-prefill.log" || true
echo "[test] oracle prefill and CPU build: $((SECONDS - start)) s"

# [Note: the failed phases] CI keeps the tail of this output; the last line names every phase
# that failed, so a failure hidden in a phase's long log still shows there.
status=0
failed_phases=()
fail() {
  status=1
  failed_phases+=("$1")
}
# The tests of a build directory's last `meson test` that did not pass, if any.
failed_tests() {
  python3 - "$1/meson-logs/testlog.json" <<'PY' 2>/dev/null || true
import json, sys
bad = [r["name"] + " (" + r["result"] + ")" for r in map(json.loads, open(sys.argv[1]))
       if r["result"] not in ("OK", "EXPECTEDFAIL", "SKIP")]
print(": " + ", ".join(bad) if bad else "")
PY
}
meson test -C "$root/build" --print-errorlogs "$@" || fail "suites$(failed_tests "$root/build")"
summary=$(python3 - "$root/build/meson-logs/testlog.json" <<'PY'
import json, sys
passed = failed = skipped = 0
for line in open(sys.argv[1]):
    r = json.loads(line)["result"]
    if r in ("OK", "EXPECTEDFAIL"):
        passed += 1
    elif r == "SKIP":
        skipped += 1
    else:
        failed += 1
print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
PY
)

# [Note: the stress job] in test/stress.py: the threaded multi-rank programs over and over
# under glibc's heap checks, for DTENSOR_STRESS_S seconds (0 skips it).
if [[ ${DTENSOR_QUICK:-0} != 1 && ${DTENSOR_STRESS_S:-90} != 0 ]]; then
  start=$SECONDS
  "$venv/bin/python" "$root/test/stress.py" "$root/build" "${DTENSOR_STRESS_S:-90}" || fail "stress"
  echo "[test] stress: $((SECONDS - start)) s"
fi

if [[ ${DTENSOR_SKIP_SANITIZE:-0} != 1 ]]; then
  start=$SECONDS
  "$root/scripts/sanitize.sh" || fail "sanitizer subset$(failed_tests "$root/build-asan")"
  echo "[test] sanitizer subset: $((SECONDS - start)) s"
fi

if [[ ${DTENSOR_SKIP_OLD_TORCH:-0} != 1 ]]; then
  start=$SECONDS
  wait $old_setup_pid || fail "LibTorch 2.9.1 set-up"
  cat "$old_setup_log"
  "$root/scripts/old-torch-test.sh" || fail "LibTorch 2.9.1 build or smoke subset$(failed_tests "$root/build-torch2.9.1")"
  echo "[test] LibTorch 2.9.1 build and smoke subset: $((SECONDS - start)) s"
fi

if [[ ${DTENSOR_SKIP_CUDA_BUILD:-0} != 1 ]]; then
  if ls "$venv"/lib/python3*/site-packages/torch/lib/libtorch_cuda.so >/dev/null 2>&1; then
    start=$SECONDS
    # The library and the main job's program: what a GPU user links (each variant builds
    # only what it checks: docs/testing.md, "Budget").
    configure "$root/build-cuda" -Dcuda=enabled -Dtests=false -Dexamples=true -Dbenchmarks=false \
      -Dwerror=true
    ninja -C "$root/build-cuda" examples/train || fail "CUDA/NCCL variant build"
    echo "[test] CUDA/NCCL variant (compile + link): $((SECONDS - start)) s"
  else
    echo "[test] no libtorch_cuda in this LibTorch: CUDA/NCCL variant not built"
  fi
fi
echo "[test] free disk: $(free_disk)"
# The budget (docs/testing.md, "Budget"): where this run's time went.
echo "[test] suites: $(python3 "$root/scripts/test_times.py" --summary "$root/build")"
echo "[test] total: $((SECONDS - total_start)) s"
echo "tests: $summary"
if ((${#failed_phases[@]})); then
  printf '[test] FAILED: %s\n' "$(IFS=';'; echo "${failed_phases[*]}")"
fi
exit $status
