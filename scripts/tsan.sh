#!/usr/bin/env bash
# The test suite under ThreadSanitizer (docs/sanitizers.md): Clang, everything instrumented,
# in build-tsan/. No CUDA (nvcc's host compiler is GCC) and no Python module (the interpreter
# is not instrumented). A TSan report fails its test: a gtest binary, or an sp-train that a
# test runs, exits 66.
#
#   bash scripts/tsan.sh [--build-only | --test-only] [ctest arguments...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/compiler-cache.sh
jobs=$(nproc 2>/dev/null || echo 2)
build=true
test=true
case ${1:-} in
  --build-only) test=false && shift ;;
  --test-only) build=false && shift ;;
esac
if [[ $build == true ]]; then
  CC=clang CXX=clang++ cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSP_SANITIZE_THREAD=ON \
    -DSP_ENABLE_CUDA=OFF -DSP_BUILD_PYTHON=OFF -DSP_BUILD_BENCH=OFF "${sp_compiler_launcher[@]}"
  cmake --build build-tsan -j "$jobs"
fi
# LibTorch, OpenBLAS and Gloo are not instrumented: their threads synchronize through atomics
# and spinning TSan cannot see, so the memory functions they call (free, memset, memcpy) would
# be reported against our accesses. Interceptors called from uninstrumented libraries are
# therefore ignored; every access of the project's own code is still checked.
if [[ $test == true ]]; then
  TSAN_OPTIONS="ignore_noninstrumented_modules=1 ${TSAN_OPTIONS:-}" \
    ctest --test-dir build-tsan --output-on-failure -j "$jobs" "$@"
fi
