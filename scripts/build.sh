#!/usr/bin/env bash
# Configures build/ and builds into it (binaries in build/bin, plugins in build/plugins). One
# tree serves every use: the main job builds what it runs there, the test command the rest, and
# `pip install` (scripts/install-package.sh) makes its wheel out of the same tree, so no source
# is compiled twice. Compiles go through ccache where it is installed (compiler-cache.sh).
#
#   bash scripts/build.sh [--target NAME]... [cmake configure arguments...]
#   bash scripts/build.sh --configure [cmake configure arguments...]   configures only
#
# With no --target it builds everything: the libraries, plugins, tools, tests and benchmarks.
# The configure step runs when build/ has no cache yet, when arguments are given, or with
# --configure; otherwise the build reconfigures by itself where a CMakeLists.txt changed.
#
# The build type is Release at -O2 (RelWithDebInfo's optimization, with which the results were
# measured; GCC 12 at CMake's Release default of -O3 raises false -Wrestrict errors in
# libstdc++'s string code), without debug information: that costs about a quarter of each
# LibTorch translation unit's compile (trainer.cpp: 72.8 s with -g, 52.1 s without, on the
# 2-core machine under load). The kernels ask for -O3 themselves. To debug, configure
# RelWithDebInfo: `bash scripts/build.sh -DCMAKE_BUILD_TYPE=RelWithDebInfo` (arguments come
# last and win).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/compiler-cache.sh
jobs=$(nproc 2>/dev/null || echo 2)
targets=()
configure_args=()
configure_only=false
while (($#)); do
  if [[ $1 == --configure ]]; then
    configure_only=true
    shift
  elif [[ $1 == --target ]]; then
    [[ $# -ge 2 ]] || { echo "build.sh: --target needs a target name" >&2; exit 2; }
    targets+=(--target "$2")
    shift 2
  else
    configure_args+=("$1")
    shift
  fi
done
if [[ $configure_only == true || ! -f build/CMakeCache.txt || ${#configure_args[@]} -gt 0 ]]; then
  release=(-DCMAKE_BUILD_TYPE=Release)
  for lang in C CXX CUDA; do release+=("-DCMAKE_${lang}_FLAGS_RELEASE=-O2 -DNDEBUG"); done
  cmake -S . -B build -G Ninja "${release[@]}" "${sp_compiler_launcher[@]}" "${configure_args[@]}"
fi
[[ $configure_only == true ]] || cmake --build build -j "$jobs" "${targets[@]}"
