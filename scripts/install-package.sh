#!/usr/bin/env bash
# Builds the Python package selective_precision as the wheel a stranger installs, and installs
# that wheel into the project's .venv (docs/packaging.md):
#   1. `pip wheel --no-build-isolation .` (pyproject.toml, scikit-build-core) out of build/, the
#      tree scripts/build.sh configures: pip builds there only what the package holds (the
#      module, the plugin, the tools), whatever build/ already holds is not compiled again, and
#      build/'s own settings (build type, tests, benchmarks, warnings as errors) are passed
#      back, so pip's configure leaves them as they were. The extension is built against the
#      venv's own torch, and the wheel's metadata pins that torch's minor;
#   2. `auditwheel repair`: the tag becomes manylinux for the glibc the binaries need. There is
#      no library to copy in: fmt, spdlog and yaml-cpp are compiled into the binaries
#      (cmake/SpDependencies.cmake), and torch's libraries and the NVIDIA wheels' are left out:
#      they belong to the torch the user installs, which the binaries find relative to
#      themselves (site-packages/torch/lib). Should a build ever need another shared library,
#      auditwheel copies it in under a name of its own, and check-wheel.sh says so;
#   3. `pip install` of that wheel into .venv.
# The wheel stays in build/wheel/ (scripts/check-wheel.sh tests it as a stranger would).
# Afterwards `.venv/bin/python -c "import selective_precision"` works from any directory, and
# .venv/bin has sp-train, sp-replay and sp-bench. Run scripts/install-deps.sh first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ -f build/CMakeCache.txt ]] || bash scripts/build.sh --target selective_precision_python
python=$PWD/.venv/bin/python
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
wheels=build/wheel
rm -rf "$wheels"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)} \
  "$python" -m pip wheel --quiet --disable-pip-version-check --no-build-isolation --no-deps "${settings[@]}" \
  -w "$wheels/built" .

# Every library torch's wheel and the NVIDIA wheels hold, by file name (their sonames), left
# to the user's torch; auditwheel finds them there to read what they need in turn.
source scripts/torch-libraries.sh
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
excluded=()
while read -r lib; do excluded+=(--exclude "$lib"); done < <(torch_library_names "$site")
library_path=$(torch_library_dirs "$site" | paste -sd:)
PATH="$PWD/.venv/bin:$PATH" AUDITWHEEL_LD_LIBRARY_PATH=$library_path "$python" -m auditwheel repair --plat auto "${excluded[@]}" \
  -w "$wheels" "$wheels"/built/*.whl 2>&1 | grep -E -v '^INFO:auditwheel\.(lddtree|wheel_abi|main_repair):' || true
wheel=$(ls "$wheels"/selective_precision-*manylinux*.whl)
"$python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheel"
echo "install-package: $(basename "$wheel")"
echo "install-package: $(cd / && "$python" -c 'import selective_precision as sp; print("selective_precision", sp.__version__, "in", sp.__file__)')"
