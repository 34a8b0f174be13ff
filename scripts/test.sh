#!/usr/bin/env bash
# The whole test suite from a fresh Debian machine: installs packages, builds, runs ctest.
# GPU tests skip cleanly when no CUDA device is present.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
