#!/usr/bin/env bash
# The configure step's answer to a Python whose torch is missing or too old (cmake/SpTorch.cmake):
# an error that names the version found, the version needed and the command that fixes it.
# Each case configures tests/cmake/torch_discovery/ against a fake torch package, a Python
# module and a CMake package that say only their version.
# Usage: torch_discovery.sh <source dir> <python>
set -euo pipefail
src=$1
python=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fake_torch() {  # fake_torch DIR VERSION: a torch package for PYTHONPATH=DIR, with its CMake package
  mkdir -p "$1/torch/share/cmake/Torch"
  cat >"$1/torch/__init__.py" <<PY
__version__ = "$2"
class _C:
    _GLIBCXX_USE_CXX11_ABI = True
PY
  echo "cmake_prefix_path = '$1/torch/share/cmake'" >"$1/torch/utils.py"
  echo 'set(Torch_FOUND TRUE)' >"$1/torch/share/cmake/Torch/TorchConfig.cmake"
  cat >"$1/torch/share/cmake/Torch/TorchConfigVersion.cmake" <<CMAKE
set(PACKAGE_VERSION "$2")
set(PACKAGE_VERSION_COMPATIBLE TRUE)
CMAKE
}

expect_failure() {  # expect_failure NAME PATTERN... : the configure fails, its output matches each PATTERN
  local name=$1
  shift
  if env "${env[@]}" cmake -S "$src/tests/cmake/torch_discovery" -B "$work/$name" -DSP_SOURCE_DIR="$src" \
      -DSP_PYTHON="$python" >"$work/$name.log" 2>&1; then
    echo "$name: the configure succeeded"; cat "$work/$name.log"; exit 1
  fi
  # CMake wraps its messages: compare with the lines joined.
  local said
  said=$(tr -s ' \n' '  ' <"$work/$name.log")
  for pattern in "$@"; do
    [[ $said == *"$pattern"* ]] || { echo "$name: no '$pattern' in:"; cat "$work/$name.log"; exit 1; }
  done
  echo "$name: refused as expected"
}

# No torch at all: an empty PYTHONPATH entry and -I keep the real one out of sight.
mkdir -p "$work/none"
env=(PYTHONPATH="$work/none" PYTHONNOUSERSITE=1)
python_isolated=$work/python
printf '#!/bin/sh\nexec "%s" -S "$@"\n' "$python" >"$python_isolated"
chmod +x "$python_isolated"
python=$python_isolated
expect_failure missing "needs LibTorch (torch 2.4 or newer)" "import torch" "No module named 'torch'" \
  "bash scripts/install-deps.sh"

fake_torch "$work/old" 1.13.1
env=(PYTHONPATH="$work/old" PYTHONNOUSERSITE=1)
expect_failure too-old "needs torch 2.4 or newer; found 1.13.1" "bash scripts/install-deps.sh"
