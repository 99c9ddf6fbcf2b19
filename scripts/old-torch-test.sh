#!/usr/bin/env bash
# dtensor against the older LibTorch it supports (2.9.1, in .venv-torch2.9.1; [Note: two
# LibTorch versions] in scripts/setup.sh): builds the library and the smoke subset's test
# programs (below) in build-torch2.9.1 and runs them on 1 and 2 ranks. The library compiles as
# unity units there (6 files a unit, as the sanitizer build: [Note: unity units] in
# lib/meson.build), which keeps this second build short; the default build keeps one unit per
# file.
#   scripts/old-torch-test.sh [extra meson test arguments]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$root/scripts/setup.sh" >/dev/null
if [[ ! -x $venv_old_torch/bin/python ]]; then
  echo "old-torch-test: no $venv_old_torch (scripts/setup.sh makes it unless DTENSOR_SKIP_OLD_TORCH=1)" >&2
  exit 2
fi

# The smoke subset: the programs that touch every LibTorch API the library uses. On 1 and 2
# ranks: collectives, redistribution, fully_shard, TP and clipping, CommDebugMode, meta init
# (c10d backends and works, autograd nodes and hooks, the dispatcher, thread-local debug
# info); on 1 rank: every sharding rule family (the dispatcher's op schemas), the attention
# kernels (whose schemas change between releases; judged by this LibTorch's meta kernels),
# selective activation checkpointing (a dispatch-key mode), checkpoints (serialization), the
# module seam, RNG (generators), reliability (c10d's debug wrapper, error paths), and the
# LibTorch configuration probe. Only these are built here (docs/build.md, "Compile time").
WORLD2=(collectives redistribute fully_shard fsdp_tp clip_grad_norm comm_debug_mode comm_debug_modules
        mesh_groups meta_init)
WORLD1=("${WORLD2[@]}" sharding_rules attention_kernels activation_checkpoint checkpoint module_hooks
        random reliability)

dir="$root/build-torch2.9.1"
start=$SECONDS
configure "$dir" -Dpython="$venv_old_torch/bin/python" -Dcuda=disabled -Dunity=off \
  -Dlib_unity_size=6 -Dexamples=false -Dbenchmarks=false -Dwerror=true
tests=(torch_config)
for t in "${WORLD1[@]}"; do
  tests+=("$t-w1")
done
for t in "${WORLD2[@]}"; do
  tests+=("$t-w2")
done
# The programs those tests run (they link the library, which comes first; test_attention_kernels
# reads the meta shapes that this LibTorch gives at build time).
mapfile -t targets < <(meson introspect "$dir" --tests | python3 -c '
import json, sys
wanted = set(sys.argv[1:])
names = set()
for t in json.load(sys.stdin):
    if t["name"] not in wanted:
        continue
    wanted.discard(t["name"])
    for c in t["cmd"]:
        # meson 1.9 gives programs of this build relative to the build directory
        if (c.startswith("test/") or "/test/" in c) and not c.endswith((".py", ".sh")):
            names.add(c)
if wanted:
    sys.exit("old-torch-test: no such tests: " + " ".join(sorted(wanted)))
print("\n".join(sorted(names)))
' "${tests[@]}" | sed "s|^$dir/||")
ninja -C "$dir" "${targets[@]}" test/attention_meta_shapes.json
echo "[old-torch] build: $((SECONDS - start)) s"
meson test -C "$dir" --no-rebuild --print-errorlogs "${tests[@]}" "$@"
