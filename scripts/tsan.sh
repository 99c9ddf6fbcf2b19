#!/usr/bin/env bash
# ThreadSanitizer over the threaded multi-rank programs: builds the library and those test
# programs in build-tsan/ (-Db_sanitize=thread, -O1, unity units as the other sanitizer build)
# and repeats them on real ranks for a budget of seconds (test/stress.py --tsan). LibTorch,
# c10d and Gloo are not instrumented: reports inside them are suppressed
# (test/sanitizer/tsan.supp), races with dtensor's own frames on both sides fail the run.
#   scripts/tsan.sh [BUDGET_S] [NAME:WORLD ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$root/scripts/setup.sh" >/dev/null
budget=${1:-120}
shift || true
programs=(fsdp_controls fsdp_overlap checkpoint comm_hooks pipelining moe)
dir="$root/build-tsan"
start=$SECONDS
configure "$dir" -Dcuda=disabled -Db_sanitize=thread -Db_lundef=false -Dunity=off \
  -Dlib_unity_size=6 -Dpch=false -Dexamples=false -Dbenchmarks=false -Ddebug=true \
  -Doptimization=1 -Dwerror=false
targets=()
for t in "${programs[@]}"; do
  targets+=("test/test_$t")
done
ninja -C "$dir" "${targets[@]}"
echo "[tsan] build: $((SECONDS - start)) s"
exec "$venv/bin/python" "$root/test/stress.py" "$dir" "$budget" --tsan "$@"
