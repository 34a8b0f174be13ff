#!/usr/bin/env bash
# Installs the Python package selective_precision into the project's .venv with
# `pip install --no-build-isolation .` (pyproject.toml, scikit-build-core), so that the
# extension is built against the venv's own torch. The wheel is made out of build/, the tree
# scripts/build.sh configures, and pip builds there only what the package holds (the module,
# the plugin, the tools): whatever build/ already holds is not compiled again, and build/'s own
# settings (build type, tests, benchmarks, warnings as errors) are passed back, so pip's configure leaves
# them as they were. Afterwards `.venv/bin/python -c "import selective_precision"` works from
# any directory, and .venv/bin has sp-train, sp-replay and sp-bench. Run scripts/install-deps.sh
# first. (A plain `pip install .` elsewhere builds in its own build-wheel/, pyproject.toml.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ -f build/CMakeCache.txt ]] || bash scripts/build.sh --target selective_precision_python
cache_value() { sed -n "s/^$1:[A-Z]*=//p" build/CMakeCache.txt; }
settings=(-C build-dir=build -C cmake.define.SP_BUILD_PYTHON=ON -C "cmake.build-type=$(cache_value CMAKE_BUILD_TYPE)"
          -C "build.targets=selective_precision_python;selective_precision_policy_plugin;sp-train;sp-replay;sp-bench")
for key in SP_BUILD_TESTS SP_BUILD_BENCH SP_BUILD_TOOLS SP_WARNINGS_AS_ERRORS; do
  settings+=(-C "cmake.define.$key=$(cache_value "$key")")
done
# scikit-build-core runs the first ninja it finds (the venv's `ninja` package, which deepspeed
# brings, before the PATH's). A ninja of another version than build/'s rewrites its logs and
# rebuilds every target, so pip is held to the version build/ was configured with.
ninja_version=$("$(cache_value CMAKE_MAKE_PROGRAM)" --version | cut -d. -f1-3)
settings+=(-C "ninja.version===$ninja_version")  # the key, "=", then "==X.Y.Z"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)} \
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps "${settings[@]}" .
python=$PWD/.venv/bin/python
echo "install-package: $(cd / && "$python" -c 'import selective_precision as sp; print("selective_precision", sp.__version__, "in", sp.__file__)')"
