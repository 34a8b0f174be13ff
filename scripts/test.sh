#!/usr/bin/env bash
# The whole test suite from a fresh Debian machine: installs packages (apt, and the .venv with
# PyPI's torch), builds, installs the Python package into the .venv, runs ctest, then the
# Python tests again against the installed package, from outside the source tree.
# GPU tests skip cleanly when no CUDA device is present.
# Then every libFuzzer harness (docs/fuzzing.md), built with Clang, ASan and UBSan in build-fuzz/:
# the replay of its seed corpus (deterministic), then a smoke run of SP_FUZZ_SMOKE_SECONDS of
# fuzzing each (label fuzz-timed), whose new inputs differ from run to run: a failure there is
# a new finding, kept in the test's build folder as crash-*, oom-* or timeout-*.
# Last, the suite again under ThreadSanitizer (Clang, build-tsan/, docs/sanitizers.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
bash scripts/install-package.sh
ctest --test-dir build --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
# The installed package, as a user's script meets it: no PYTHONPATH, run from /tmp. The one
# test that compares with the C++ layer's own run is given that program from the build.
root=$PWD
(cd /tmp && SP_TORCH_LAYER_REFERENCE="$root/build/bin/sp_torch_layer_reference" OMP_NUM_THREADS=1 \
  "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider "$root/python/tests")

# Only the harnesses and what they link: no tools, tests, benchmarks, LibTorch or CUDA.
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSP_BUILD_FUZZERS=ON \
  -DSP_BUILD_TESTS=OFF -DSP_BUILD_TOOLS=OFF -DSP_BUILD_BENCH=OFF -DSP_BUILD_TORCH=OFF -DSP_BUILD_PYTHON=OFF \
  -DSP_ENABLE_CUDA=OFF
cmake --build build-fuzz --target selective_precision_fuzzers -j "$(nproc 2>/dev/null || echo 2)"
ctest --test-dir build-fuzz -L '^fuzz$' --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
ctest --test-dir build-fuzz -L fuzz-timed --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"

bash scripts/tsan.sh
