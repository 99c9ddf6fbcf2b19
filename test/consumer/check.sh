#!/usr/bin/env bash
# Builds test/consumer with CMake the two ways a downstream project finds dtensor and checks
# what the program computes each time:
#  1. pkg-config, against the build tree's uninstalled dtensor.pc;
#  2. find_package(dtensor CONFIG REQUIRED), against an installation of this build made with
#     `meson install --destdir` (the CMake package is relocatable, [Note: CMake package]).
# usage: check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$(cd "$1" && pwd) build=$(cd "$2" && pwd)
meson=${MESON:-$src/.venv/bin/meson}
[[ -x $meson ]] || meson=meson

run() { # name, library directory
  local out
  out=$(if [[ -n $2 ]]; then LD_LIBRARY_PATH=$2 "$build/consumer-$1/consumer"; else
         env -u LD_LIBRARY_PATH "$build/consumer-$1/consumer"; fi 2>&1)
  echo "$1: $out"
  grep -q "consumer: sum=6 all_reduce=1" <<<"$out"
}

# 1. pkg-config
work=$build/consumer-pkgconfig
PKG_CONFIG_PATH=$build/meson-uninstalled${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH} \
  cmake -S "$src/test/consumer" -B "$work" -DDTENSOR_FIND=pkgconfig -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build "$work" >/dev/null
run pkgconfig "$build/lib"

# 2. find_package(dtensor CONFIG) on a staged installation
stage=$build/consumer-stage
rm -rf "$stage"
"$meson" install -C "$build" --no-rebuild --quiet --destdir "$stage" >/dev/null
# Every public header is installed, and <dtensor/all.h> includes every other one.
for h in "$src"/include/dtensor/*.h; do
  b=$(basename "$h")
  [[ -n $(find "$stage" -path "*/include/dtensor/$b") ]] || { echo "public header $b is not installed (include/dtensor/meson.build)" >&2; exit 1; }
  [[ $b == all.h ]] || grep -q "^#include <dtensor/$b>" "$src/include/dtensor/all.h" || { echo "<dtensor/all.h> does not include $b" >&2; exit 1; }
done
cfg=$(find "$stage" -name dtensorConfig.cmake -print -quit)
[[ -n $cfg ]] || { echo "no dtensorConfig.cmake installed under $stage" >&2; exit 1; }
prefix=$stage$(sed -n 's/^prefix=//p' "$build/meson-private/dtensor.pc")  # CMake searches PREFIX/LIBDIR/cmake
work=$build/consumer-config
rm -rf "$work"
cmake -S "$src/test/consumer" -B "$work" -DDTENSOR_FIND=config -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build "$work" >/dev/null
# The program must load the staged libdtensor (CMake's build rpath names it), not the build's
# (meson test puts the build's lib/ on LD_LIBRARY_PATH). ldd's output is read whole first:
# `ldd | grep -q` under pipefail fails when grep stops early and ldd gets SIGPIPE.
loads=$(env -u LD_LIBRARY_PATH ldd "$work/consumer")
grep -q "libdtensor.so.0 => $stage" <<<"$loads" ||
  { echo "consumer does not load $stage's libdtensor:" >&2; echo "$loads" >&2; exit 1; }
run config ""
