#!/usr/bin/env bash
# Builds test/consumer with CMake against the build tree's pkg-config file for dtensor and
# checks what the program computes. usage: check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
work=$build/consumer-cmake
export PKG_CONFIG_PATH=$build/meson-uninstalled${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
cmake -S "$src/test/consumer" -B "$work" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build "$work" >/dev/null
out=$(LD_LIBRARY_PATH=$build/lib "$work/consumer" 2>&1)
echo "$out"
grep -q "consumer: sum=6 all_reduce=1" <<<"$out"
