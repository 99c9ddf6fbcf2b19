#!/usr/bin/env bash
# AddressSanitizer (with LeakSanitizer) + UndefinedBehaviorSanitizer: builds the library and test programs in
# build-asan/ (-Db_sanitize=address,undefined; the library as unity units to keep the compile short) and
# runs them on real ranks. Any sanitizer report fails the run (halt_on_error); the only
# suppressions are LibTorch's own, each explained in test/sanitizer/*.supp. Warnings are not
# errors there (GCC's -Wmaybe-uninitialized gives false positives in libstdc++ under the
# sanitizers; the test command's other builds keep -Werror). The library compiles at -O1, AddressSanitizer's
# own advice: a unit takes 40% less time than at -O2 (31 s against 52 s), and reports keep
# their file:line.
#   scripts/sanitize.sh          the CI subset (see SUBSET below) on 1 and 2 ranks
#   scripts/sanitize.sh --all    every test program of the world1 and world2 suites
# Extra arguments go to `meson test`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$root/scripts/setup.sh" >/dev/null

# The programs that exercise the most library code per second of run time: dispatch,
# every rule family, redistribution, state dicts, process-group debug wrapping; and
# fsdp_overlap, whose collectives stay in flight while their buffers live on.
SUBSET=(reliability random_ops redistribute sharding_rules fsdp_overlap)

all=0
if [[ ${1:-} == --all ]]; then
  all=1
  shift
fi

dir="$root/build-asan"
start=$SECONDS
configure "$dir" -Dcuda=disabled -Db_sanitize=address,undefined -Db_lundef=false \
  -Dunity=off -Dlib_unity_size=6 -Dpch=false -Dexamples=false -Dbenchmarks=false -Ddebug=true -Doptimization=1 \
  -Dwerror=false
supp="$root/test/sanitizer"
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1:suppressions=$supp/asan.supp"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp"

if [[ $all == 1 ]]; then
  ninja -C "$dir"
  echo "[sanitize] build: $((SECONDS - start)) s"
  meson test -C "$dir" --no-rebuild --print-errorlogs --suite world1 --suite world2 "$@"
else
  targets=()
  tests=()
  for t in "${SUBSET[@]}"; do
    targets+=("test/test_$t")
    tests+=("$t-w1" "$t-w2")
  done
  ninja -C "$dir" "${targets[@]}"
  echo "[sanitize] build: $((SECONDS - start)) s"
  meson test -C "$dir" --no-rebuild --print-errorlogs "${tests[@]}" detail-w2 "$@"
fi
