#!/usr/bin/env bash
# dtensor against the older LibTorch it supports (2.9.1, in .venv-torch2.9.1; [Note: two
# LibTorch versions] in scripts/setup.sh): builds the library and the world1 test programs in
# build-torch2.9.1 and runs the world1 suite (but the conformance suite, whose oracle is the
# default PyTorch) and a few world2 tests. The library compiles as unity units there
# (6 files a unit, as the sanitizer build), which keeps this second build short; the default
# build keeps one unit per file.
#   scripts/old-torch-test.sh [extra meson test arguments]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$root/scripts/setup.sh" >/dev/null
if [[ ! -x $venv_old_torch/bin/python ]]; then
  echo "old-torch-test: no $venv_old_torch (scripts/setup.sh makes it unless DTENSOR_SKIP_OLD_TORCH=1)" >&2
  exit 2
fi

# The world2 tests of the smoke subset: collectives, redistribution, fully_shard, TP and
# clipping, which touch every LibTorch API the library uses across ranks (c10d backends and
# works, autograd nodes and hooks, the dispatcher, thread-local debug info).
WORLD2=(collectives redistribute fully_shard fsdp_tp clip_grad_norm comm_debug_mode comm_debug_modules
        mesh_groups meta_init)

dir="$root/build-torch2.9.1"
start=$SECONDS
configure "$dir" -Dpython="$venv_old_torch/bin/python" -Dcuda=disabled -Dunity=on \
  -Dunity_size=6 -Dexamples=false -Dbenchmarks=false
mapfile -t targets < <(meson introspect "$dir" --tests | python3 -c '
import json, sys
names = set()
for t in json.load(sys.stdin):
    if any("conformance" in s for s in t["suite"]):  # suites read "dtensor:conformance"
        continue
    for c in t["cmd"]:
        # meson 1.9 gives programs of this build relative to the build directory
        if (c.startswith("test/") or "/test/" in c) and not c.endswith((".py", ".sh")):
            names.add(c)
print("\n".join(sorted(names)))
' | sed "s|^$dir/||")
# (they link the library, which comes first; test_attention_kernels reads the meta shapes
# that the venv's torch gives at build time)
ninja -C "$dir" "${targets[@]}" test/attention_meta_shapes.json
echo "[old-torch] build: $((SECONDS - start)) s"
tests=()
for t in "${WORLD2[@]}"; do
  tests+=("$t-w2")
done
mapfile -t world1 < <(meson introspect "$dir" --tests | python3 -c '
import json, sys
for t in json.load(sys.stdin):
    if "dtensor:world1" in t["suite"] and not any("conformance" in s for s in t["suite"]):
        print(t["name"])
')
meson test -C "$dir" --no-rebuild --print-errorlogs "${world1[@]}" "$@"
meson test -C "$dir" --no-rebuild --print-errorlogs "${tests[@]}" "$@"
