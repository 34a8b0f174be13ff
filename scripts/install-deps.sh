#!/usr/bin/env bash
# Installs the Debian packages the build needs. Safe to run again: it asks apt only for
# what is missing. Run as root (or with sudo available) on Debian bookworm.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libyaml-cpp-dev libspdlog-dev libfmt-dev libboost-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev
  binutils python3
  # sp-train: Debian's CPU LibTorch; its c10d headers need Gloo's, and without OpenBLAS
  # it falls back to a slow reference BLAS.
  libtorch-dev libgloo-dev libopenblas0-pthread
  # The Python module: Debian's Python torch (the same libtorch, and torchrun), pybind11, and
  # pytest for its tests.
  python3-dev python3-torch pybind11-dev python3-pytest
  # The libFuzzer harnesses (docs/fuzzing.md): Clang, and the package that holds
  # libclang_rt.fuzzer-x86_64.a and the sanitizer runtimes for it.
  clang libclang-rt-14-dev
)
packages+=("$@")

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

as_root=()
[[ $(id -u) -eq 0 ]] || as_root=(sudo)
echo "install-deps: installing ${missing[*]}"
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
