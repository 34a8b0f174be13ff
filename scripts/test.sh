#!/usr/bin/env bash
# The whole test suite from a fresh Debian machine: installs packages, builds, runs ctest.
# GPU tests skip cleanly when no CUDA device is present.
# Then every libFuzzer harness over its seed corpus (docs/fuzzing.md), built with Clang, ASan and
# UBSan in build-fuzz/: the deterministic replay. The timed fuzzing (label fuzz-timed) finds
# different inputs on each run, so it is not part of the test command.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"

# Only the harnesses and what they link: no tools, tests, benchmarks, LibTorch or CUDA.
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSP_BUILD_FUZZERS=ON \
  -DSP_BUILD_TESTS=OFF -DSP_BUILD_TOOLS=OFF -DSP_BUILD_BENCH=OFF -DSP_BUILD_TORCH=OFF -DSP_BUILD_PYTHON=OFF \
  -DSP_ENABLE_CUDA=OFF
cmake --build build-fuzz --target selective_precision_fuzzers -j "$(nproc 2>/dev/null || echo 2)"
ctest --test-dir build-fuzz -L '^fuzz$' --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
