#!/usr/bin/env bash
# Configures and builds the project into build/ (binaries in build/bin, plugins in
# build/plugins). Extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
cmake --build build -j "$jobs"
