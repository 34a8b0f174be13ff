#!/usr/bin/env bash
# The whole test suite from a fresh Debian machine: installs packages (apt, and the .venv with
# PyPI's torch and every pinned Python package), builds everything into build/, installs the
# Python package's wheel out of that same tree (no second compile), repairs it for manylinux and
# installs it into the .venv, runs ctest, then the Python tests again against that wheel in a
# fresh venv, from outside the source tree, with Debian's yaml-cpp, spdlog and fmt hidden.
# GPU tests skip cleanly when no CUDA device is present.
# Then every libFuzzer harness (docs/fuzzing.md), built with Clang, ASan and UBSan in build-fuzz/:
# the replay of its seed corpus (deterministic), then a smoke run of SP_FUZZ_SMOKE_SECONDS of
# fuzzing each (label fuzz-timed), whose new inputs differ from run to run: a failure there is
# a new finding, kept in the test's build folder as crash-*, oom-* or timeout-*.
# Last, the suites of the code that runs threads again under ThreadSanitizer (Clang, build-tsan/,
# docs/sanitizers.md).
# Each stage prints its duration, and a table of them closes the run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/stages.sh
source scripts/compiler-cache.sh
jobs=$(nproc 2>/dev/null || echo 2)

sp_stage apt bash scripts/install-deps.sh apt
sp_stage venv bash scripts/install-deps.sh venv --python all
sp_stage configure bash scripts/build.sh --configure
sp_stage build bash scripts/build.sh
sp_stage package bash scripts/install-package.sh
# SP_REQUIRE_WHEEL: the test of the wheel's C++ package may not skip (tests/CMakeLists.txt).
SP_REQUIRE_WHEEL=1 sp_stage ctest ctest --test-dir build --output-on-failure -j "$jobs"

# The wheel as a stranger installs it: its tag and what it needs (auditwheel), a fresh venv
# with only its requirements, and the package's tests there, from /tmp, where Debian's
# yaml-cpp, spdlog and fmt cannot be loaded (scripts/check-wheel.sh).
sp_stage wheel-check bash scripts/check-wheel.sh

# Only the harnesses and what they link: no tools, tests, benchmarks, LibTorch or CUDA.
fuzz_build() {
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSP_BUILD_FUZZERS=ON \
    -DSP_BUILD_TESTS=OFF -DSP_BUILD_TOOLS=OFF -DSP_BUILD_BENCH=OFF -DSP_BUILD_TORCH=OFF -DSP_BUILD_PYTHON=OFF \
    -DSP_ENABLE_CUDA=OFF "${sp_compiler_launcher[@]}"
  cmake --build build-fuzz --target selective_precision_fuzzers -j "$jobs"
}
sp_stage fuzz-build fuzz_build
sp_stage fuzz-replay ctest --test-dir build-fuzz -L '^fuzz$' --output-on-failure -j "$jobs"
sp_stage fuzz-smoke ctest --test-dir build-fuzz -L fuzz-timed --output-on-failure -j "$jobs"

sp_stage tsan-build bash scripts/tsan.sh --build-only
sp_stage tsan-ctest bash scripts/tsan.sh --test-only
sp_stage_summary
