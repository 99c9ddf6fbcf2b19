#!/usr/bin/env bash
# The installation as a user gets it (docs/build.md, "Installing"): `meson install --destdir`
# of this build into a fresh staging directory, then, against that installation only:
#  1. what is installed: the library, every public header (each included by <dtensor/all.h>),
#     every models/ header, the pkg-config file, the CMake package, `train`, the LICENSE; the
#     CMake package and the pkg-config file name no LibTorch path; no installed file and no
#     RUNPATH names the build tree, nor the source tree outside LibTorch's own directory;
#     `train` finds libdtensor through $ORIGIN;
#  2. a CMake consumer configured with CMAKE_PREFIX_PATH="<prefix>;<torch>/share/cmake" and
#     nothing else (dtensorConfig.cmake finds LibTorch with find_package(Torch));
#  3. a pkg-config consumer, compiled with `pkg-config --cflags --libs dtensor` and LibTorch's
#     flags;
#  4. both run on 1 and 2 ranks (test/launch.py) from the staged library (consumer.cpp: a
#     DTensor product and a fully_shard Llama 3 from the installed models against the plain
#     ones), and the installed `train` runs two steps.
# The configured prefix is kept (the stage is <stage><prefix>, as for a package), so the
# installation runs from a place other than the one it was configured for; pkg-config is told
# where with --define-variable=prefix. A LibTorch from a CUDA wheel needs a CUDA toolkit
# (nvcc) for its TorchConfig.cmake: without one, part 2 cannot run and the test reports SKIP
# (exit 77) after the other parts pass.
# usage: check.sh SOURCE_DIR BUILD_DIR TORCH_PREFIX WITH_TRAIN(true|false)
set -euo pipefail
src=$(cd "$1" && pwd) build=$(cd "$2" && pwd) torch=$(cd "$3" && pwd) with_train=$4
meson=${MESON:-$src/.venv/bin/meson}
[[ -x $meson ]] || meson=meson
fail() {
  echo "installed_consumer: $*" >&2
  exit 1
}
start=$SECONDS
phase() { echo "[consumer] $1: $((SECONDS - start)) s"; }

# The consumers compile in fixed directories of the build tree, so ccache (CCACHE_BASEDIR,
# scripts/env.sh) serves them to the next run and to other clones; the stage is made afresh.
work=$build/consumer
stage=$work/stage
rm -rf "$stage" "$work/cmake" "$work/pkgconfig" "$work/train"
mkdir -p "$work/pkgconfig" "$work/train"
read -r prefix libdir bindir includedir datadir < <("$meson" introspect "$build" --buildoptions | python3 -c '
import json, sys
o = {x["name"]: x["value"] for x in json.load(sys.stdin)}
print(o["prefix"], o["libdir"], o["bindir"], o["includedir"], o["datadir"])')
"$meson" install -C "$build" --no-rebuild --quiet --destdir "$stage" >/dev/null
root=$stage$prefix
lib=$root/$libdir inc=$root/$includedir
phase install

# 1. What is installed.
[[ -f $lib/libdtensor.so.0 ]] || fail "no $lib/libdtensor.so.0"
for h in "$src"/include/dtensor/*.h; do
  b=$(basename "$h")
  [[ -f $inc/dtensor/$b ]] || fail "public header $b is not installed (include/dtensor/meson.build)"
  [[ $b == all.h ]] || grep -q "^#include <dtensor/$b>" "$src/include/dtensor/all.h" ||
    fail "<dtensor/all.h> does not include $b"
done
while read -r h; do
  [[ -f $inc/dtensor-models/$h ]] || fail "$h is not installed under $inc/dtensor-models"
done < <(cd "$src" && find models -name '*.h')
pc=$lib/pkgconfig/dtensor.pc cfg=$lib/cmake/dtensor/dtensorConfig.cmake
cmp -s "$src/LICENSE" "$root/$datadir/licenses/dtensor/LICENSE" || fail "LICENSE is not installed"
[[ -f $pc ]] || fail "no $pc"
[[ -f $cfg ]] || fail "no $cfg"
grep -q '^torch_version=[0-9]' "$pc" || fail "$pc names no torch_version"
# The CMake package and the pkg-config file follow the LibTorch the consumer names: neither
# names the one dtensor was built with.
grep -q -- "$torch" "$cfg" "$pc" && fail "$(grep -n -- "$torch" "$cfg" "$pc" | head -3): names LibTorch's path"
# Text files: no build-tree path, and no source-tree path but LibTorch's (a venv in the clone).
names_tree() { # file
  local t
  t=$(sed "s#$torch##g" "$1")
  grep -q -- "$build" <<<"$t" || grep -q -- "$src/" <<<"$t"
}
while read -r f; do
  names_tree "$f" && fail "$f names the build or source tree: $(grep -n -- "$build\|$src/" "$f" | head -3)"
done < <(grep -rIl . "$stage")
# RUNPATHs: $ORIGIN-relative or LibTorch's directory.
runpath() { readelf -d "$1" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p'; }
bins=("$lib/libdtensor.so.0")
[[ $with_train == true ]] && bins+=("$root/$bindir/train")
for b in "${bins[@]}"; do
  [[ -f $b ]] || fail "no $b"
  IFS=: read -ra entries <<<"$(runpath "$b")"
  for e in "${entries[@]}"; do
    [[ $e == "\$ORIGIN"* || $e == "$torch"* ]] || fail "$b has RUNPATH entry $e (neither \$ORIGIN nor LibTorch's)"
  done
  echo "[consumer] $(basename "$b") RUNPATH: $(runpath "$b")"
done
if [[ $with_train == true ]]; then
  rel=$(python3 -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$lib" "$root/$bindir")
  runpath "$root/$bindir/train" | tr : '\n' | grep -qx "\$ORIGIN/$rel" ||
    fail "train's RUNPATH lacks \$ORIGIN/$rel: $(runpath "$root/$bindir/train")"
fi

# A program must load the staged libdtensor, not the build's (meson test puts the build's lib/
# on LD_LIBRARY_PATH: every run below is without it). ldd's output is read whole first:
# `ldd | grep -q` under pipefail fails when grep stops early and ldd gets SIGPIPE.
loads_staged() { # program
  local loads path
  loads=$(env -u LD_LIBRARY_PATH ldd "$1")
  path=$(sed -n 's/^[[:space:]]*libdtensor.so.0 => \(.*\) (0x.*/\1/p' <<<"$loads")
  [[ -n $path && $(realpath "$path") == $(realpath "$lib/libdtensor.so.0") ]] ||
    fail "$1 does not load $lib/libdtensor.so.0: $(grep dtensor <<<"$loads")"
}
run_consumer() { # label, program
  local n out
  loads_staged "$2"
  for n in 1 2; do
    out=$(env -u LD_LIBRARY_PATH python3 "$src/test/launch.py" "$n" "$2" 2>&1) ||
      fail "the $1 consumer failed on $n rank(s): $out"
    grep -q "^consumer: $n rank(s) ok$" <<<"$out" || fail "the $1 consumer on $n rank(s) said: $out"
    echo "[consumer] $1, $n rank(s): $out"
  done
}
launcher=()
command -v ccache >/dev/null && launcher=(ccache)
# -O1: the program is small and runs once; NDEBUG as dtensor and LibTorch ([Note: NDEBUG]).
opt=(-O1 -DNDEBUG)

# 2. CMake, with the prefix and LibTorch's CMake directory only.
cmake_skip=
has_nvcc() {
  command -v nvcc >/dev/null && return 0
  local d
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    [[ -n $d && -x $d/bin/nvcc ]] && return 0
  done
  return 1
}
if [[ -f $torch/lib/libtorch_cuda.so ]] && ! has_nvcc; then
  cmake_skip="this LibTorch is a CUDA build, whose TorchConfig.cmake needs a CUDA toolkit (nvcc); none found"
else
  if ! cmake -S "$src/test/consumer" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$root;$torch/share/cmake" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="${opt[*]}" \
      ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER=ccache} >"$work/cmake.log" 2>&1; then
    cat "$work/cmake.log" >&2
    fail "the CMake consumer did not configure"
  fi
  found=$(sed -n 's/^dtensor_DIR:PATH=//p' "$work/cmake/CMakeCache.txt")
  [[ $found == "$lib/cmake/dtensor" ]] || fail "CMake found dtensor in $found, not in $lib/cmake/dtensor"
  phase "CMake configure"
  cmake --build "$work/cmake" >"$work/cmake-build.log" 2>&1 ||
    { cat "$work/cmake-build.log" >&2; fail "the CMake consumer did not build"; }
  phase "CMake build"
  run_consumer CMake "$work/cmake/consumer"
fi

# 3. pkg-config: dtensor's flags from the installed file, LibTorch's from its prefix.
dtensor_flags=$(PKG_CONFIG_PATH=$lib/pkgconfig pkg-config --define-variable=prefix="$root" \
  --cflags --libs dtensor)
# shellcheck disable=SC2054 # -Wl,-rpath,DIR is one word
torch_flags=(-isystem "$torch/include" -isystem "$torch/include/torch/csrc/api/include"
             -L"$torch/lib" -Wl,-rpath,"$torch/lib" -ltorch_cpu -lc10)
echo "[consumer] pkg-config --cflags --libs dtensor: $dtensor_flags"
# Compiled and linked apart: ccache caches compilations only. (The flags are words.)
# shellcheck disable=SC2086
(cd "$work/pkgconfig" &&
  "${launcher[@]}" "${CXX:-c++}" -std=c++20 "${opt[@]}" $dtensor_flags "${torch_flags[@]}" \
    -c "$src/test/consumer/consumer.cpp" -o consumer.o &&
  "${CXX:-c++}" consumer.o -o consumer $dtensor_flags "${torch_flags[@]}" -Wl,-rpath,"$lib") ||
  fail "the pkg-config consumer did not build"
phase "pkg-config build"
run_consumer pkg-config "$work/pkgconfig/consumer"

# 4. The installed train: two steps of the recipe on one rank, from the prefix.
if [[ $with_train == true ]]; then
  loads_staged "$root/$bindir/train"
  # Two steps: the recipe exits non-zero unless its loss falls from the first to the last.
  out=$(cd "$work/train" && env -u LD_LIBRARY_PATH "$root/$bindir/train" --steps 2 2>&1) ||
    fail "the installed train failed: $out"
  grep -q "(falling)" <<<"$out" || fail "the installed train's loss did not fall: $out"
  echo "[consumer] train: $(grep "^loss" <<<"$out")"
  phase "train"
fi
phase total
if [[ -n $cmake_skip ]]; then
  echo "[consumer] SKIP the CMake consumer: $cmake_skip"
  exit 77
fi
