#!/usr/bin/env bash
# Installs the Python package selective_precision, built from this tree, into the project's
# .venv: `pip install --no-build-isolation .` (pyproject.toml, scikit-build-core), so that the
# extension is built against the venv's own torch. Its CMake build is kept in build-wheel/, so
# a second run rebuilds only what changed. Afterwards `.venv/bin/python -c "import
# selective_precision"` works from any directory, and .venv/bin has sp-train, sp-replay and
# sp-bench. Run scripts/install-deps.sh first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)} \
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps .
python=$PWD/.venv/bin/python
echo "install-package: $(cd / && "$python" -c 'import selective_precision as sp; print("selective_precision", sp.__version__, "in", sp.__file__)')"
